"""The streaming client and `infer bench serve` against a real HTTP server (bench_peer.py: uvicorn
+ FastAPI streaming OpenAI SSE), checked against what the server itself saw."""

import asyncio
import dataclasses
import importlib.util
import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from infer.bench.serving.cli import main as bench_main
from infer.bench.serving.client import run_workload
from infer.bench.serving.report import duration_line, serve_markdown
from infer.bench.serving.runner import benchmark_server
from infer.bench.serving.stats import run_stats
from infer.bench.serving.workloads import SHAPES, WorkloadShape, make_workload

_spec = importlib.util.spec_from_file_location("bench_peer", Path(__file__).with_name("bench_peer.py"))
bench_peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_peer)

FIRST_TOKEN_DELAY_S = 0.03
TOKEN_DELAY_S = 0.005
TINY_COMPLETIONS = WorkloadShape("completion", prompt_tokens=(4, 16), output_tokens=(3, 6))
TINY_CHAT = WorkloadShape("chat", output_tokens=(2, 4), system_prompt_words=40, user_words=(2, 5))


class ThreadedServer:
    """A uvicorn server on a free port in a background thread."""

    def __init__(self, app):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the test server did not start in 10 s"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _peer(**options):
    app = bench_peer.create_peer_app(
        first_token_delay_s=FIRST_TOKEN_DELAY_S, token_delay_s=TOKEN_DELAY_S, **options
    )
    return app, ThreadedServer(app)


@pytest.mark.parametrize("client_processes", [1, 2], ids=["one-process", "two-processes"])
def test_records_match_what_the_server_sent_and_received(client_processes):
    """Also with the timed streams read by two client processes (2 + 1 workers) that take
    requests from one shared counter."""
    workload = make_workload("tiny", shape=TINY_COMPLETIONS, concurrency=3, num_requests=7, vocab_size=100)
    app, server = _peer()
    with server:
        run = asyncio.run(
            run_workload(
                workload, base_url=server.base_url, model="peer-model", client_processes=client_processes
            )
        )
    assert run.client_processes == client_processes
    peer = app.state.peer
    # The peer saw warm-up, probe, then every request once with its exact token ids.
    timed = peer["received"][2:]
    assert sorted(body["prompt"] for body in timed) == sorted(r.prompt_token_ids for r in workload.requests)
    assert all(body["ignore_eos"] is True and body["stream"] is True for body in timed)
    assert run.ignore_eos_sent and not run.notes
    for record, request in zip(run.records, workload.requests, strict=True):
        assert record.ok, record.error
        assert record.num_output_tokens == request.max_tokens == len(record.chunk_times)
        assert record.output_tokens_from == "usage"
        assert record.num_prompt_tokens == len(request.prompt_token_ids)
        assert record.finish_reason == "length"
        assert record.ttft_s >= FIRST_TOKEN_DELAY_S
        assert len(record.itl_s) == request.max_tokens - 1
        # The server cannot finish sooner than its sleeps add up to.
        assert record.e2e_s >= FIRST_TOKEN_DELAY_S + (request.max_tokens - 1) * TOKEN_DELAY_S
        assert record.send_time < record.first_token_time <= record.chunk_times[-1] <= record.end_time
        assert run.start_time <= record.send_time and record.end_time <= run.end_time
    # The closed loop keeps exactly `concurrency` requests in flight while enough remain.
    assert peer["max_in_flight"] == workload.concurrency
    assert run.probe is not None and run.probe.num_output_tokens == 1
    # Single gaps jitter either way with scheduling; their median cannot sit below the sleep.
    assert statistics.median(gap for r in run.records for gap in r.itl_s) >= TOKEN_DELAY_S * 0.8


# What a send may come after the worker's look at the clock: the two are a few Python lines apart
# with no await between, so only a descheduled thread makes it more than microseconds.
SEND_AFTER_CHECK_S = 0.01


@pytest.mark.parametrize("client_processes", [1, 2], ids=["one-process", "two-processes"])
def test_a_time_cap_stops_taking_requests_and_lets_those_in_flight_end(client_processes):
    """A 0.3 s cap on a closed loop of 40 requests of about 50 ms each (4 workers: about 0.5 s
    without it): no request is sent after the cap, the ones in flight at it end and are counted,
    the indices taken are the first ones, the rest are counted as not started; the peer saw
    exactly the requests that have records. With two client processes the deadline reaches them
    through shared memory."""
    duration_s = 0.3
    workload = make_workload("tiny", shape=TINY_COMPLETIONS, concurrency=4, num_requests=40, vocab_size=100)
    app, server = _peer()
    with server:
        run = asyncio.run(
            run_workload(
                workload,
                base_url=server.base_url,
                model="peer-model",
                warmup=False,
                client_processes=client_processes,
                duration_s=duration_s,
            )
        )
    deadline = run.start_time + duration_s
    started = len(run.records)
    assert 0 < started < workload.num_requests
    assert len(app.state.peer["received"]) == started
    assert sorted(record.index for record in run.records) == list(range(started))
    assert all(record.send_time <= deadline + SEND_AFTER_CHECK_S for record in run.records)
    assert all(record.ok for record in run.records), [record.error for record in run.records]
    # Those in flight at the cap ran to their end, and the run's end is the last of them.
    assert any(record.end_time > deadline for record in run.records)
    assert run.end_time >= max(record.end_time for record in run.records)
    assert run.duration_s == duration_s
    stopped = {"requests_not_started": workload.num_requests - started, "sessions_cut_short": 0}
    assert run.stopped_by_duration == stopped
    stats = run_stats(run)
    assert (stats["duration_s"], stats["stopped_by_duration"]) == (duration_s, stopped)


def test_one_request_per_client_sends_all_at_once():
    """The peer holds every stream until five requests are in flight at once: a client that sent
    them one after another would see them through at most one at a time."""
    workload = make_workload("tiny", shape=TINY_COMPLETIONS, concurrency=5, num_requests=5, vocab_size=100)
    app, server = _peer(hold_until_in_flight=5)
    with server:
        run = asyncio.run(run_workload(workload, base_url=server.base_url, model="peer-model", warmup=False))
    assert all(record.ok for record in run.records)
    assert app.state.peer["max_in_flight"] == 5


def test_ignore_eos_rejected_with_422_is_dropped_and_noted():
    workload = make_workload("tiny", shape=TINY_COMPLETIONS, concurrency=2, num_requests=3, vocab_size=100)
    app, server = _peer(reject_ignore_eos=True)
    with server:
        run = asyncio.run(run_workload(workload, base_url=server.base_url, model="peer-model"))
    assert not run.ignore_eos_sent
    assert "rejected ignore_eos" in run.notes[0]
    assert all(record.ok for record in run.records)
    assert all("ignore_eos" not in body for body in app.state.peer["received"])


def test_chat_requests_skip_the_role_chunk_and_take_prompt_tokens_from_usage():
    workload = make_workload("tinychat", shape=TINY_CHAT, concurrency=2, num_requests=4)
    app, server = _peer()
    with server:
        run = asyncio.run(run_workload(workload, base_url=server.base_url, model="peer-model"))
    for record, request in zip(run.records, workload.requests, strict=True):
        assert record.ok, record.error
        assert record.endpoint == "/v1/chat/completions"
        assert len(record.chunk_times) == request.max_tokens  # the role-only chunk carries no text
        assert record.num_prompt_tokens == sum(len(m["content"].split()) for m in request.messages)
        assert record.ttft_s >= FIRST_TOKEN_DELAY_S


def test_wrong_model_fails_the_warm_up_with_a_pointer_to_v1_models():
    workload = make_workload("tiny", shape=TINY_COMPLETIONS, concurrency=1, num_requests=1, vocab_size=100)
    _, server = _peer()
    with server, pytest.raises(RuntimeError, match="v1/models"):
        asyncio.run(run_workload(workload, base_url=server.base_url, model="not-served"))


def test_report_records_server_info_engine_config_and_server_queue_time(tmp_path):
    config_path = tmp_path / "engine.json"
    config_path.write_text(json.dumps({"model": "peer-model", "batching_mode": "static"}))
    workload = make_workload("tiny", shape=TINY_COMPLETIONS, concurrency=2, num_requests=4, vocab_size=100)
    _, server = _peer()
    with server:
        report = asyncio.run(
            benchmark_server(workload, base_url=server.base_url, engine_config_file=config_path)
        )
    json.dumps(report)  # everything is plain data
    assert report["model"] == "peer-model"  # the first of /v1/models
    assert report["server"]["engine_config"]["batching_mode"] == "static"
    # Defaults filled in by EngineConfig: max_batch_size is the device's (auto) until the engine runs.
    assert report["server"]["engine_config"]["max_batch_size"] is None
    assert report["server"]["engine_config"]["max_queue_len"] == 1024
    assert report["server"]["memory_after_run"]["infer_kv_cache_total_bytes"] == 65536
    # The peer's queue histogram gained the 4 timed requests (the warm-up and probe came before).
    assert report["stats"]["queue_wait_s"]["count"] == 4
    assert report["stats"]["queue_wait_s"]["mean"] == pytest.approx(FIRST_TOKEN_DELAY_S)
    assert len(report["records"]) == 4


def test_cli_serve_writes_json_and_markdown(tmp_path):
    _, server = _peer()
    json_path, md_path = tmp_path / "run.json", tmp_path / "run.md"
    with server:
        status = bench_main([
            "serve", "--base-url", server.base_url, "--model", "peer-model", "--workload", "W2",
            "--concurrency", "2", "--num-requests", "2", "--vocab-size", "50",
            "--json", str(json_path), "--md", str(md_path),
        ])  # fmt: skip
    assert status == 0
    report = json.loads(json_path.read_text())
    assert report["workload"]["name"] == "W2" and report["stats"]["num_ok"] == 2
    assert report["stats"]["output_tokens"] == sum(r["max_tokens"] for r in report["records"])
    assert f"{report['stats']['output_tokens_per_s']:.1f}" in md_path.read_text()


def test_against_our_server_token_counts_agree_with_its_metrics(tmp_path):
    import torch

    from infer.bench.serving.server_info import parse_prometheus_text
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.random_checkpoint import PRESETS, make_random_checkpoint
    from infer.server.app import create_app

    checkpoint = make_random_checkpoint("llama-tiny", tmp_path / "llama-tiny", dtype=torch.float32)
    config = EngineConfig(model=str(checkpoint), device="cpu", max_batch_size=2, max_seq_len=64)
    vocab = PRESETS["llama-tiny"].config["vocab_size"]
    workload = make_workload("tiny", shape=TINY_COMPLETIONS, concurrency=2, num_requests=3, vocab_size=vocab)
    with ThreadedServer(create_app(lambda: Engine(config))) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.base_url}/health").status_code != 200:  # 503 while the model loads
            assert time.monotonic() < deadline, "our server did not become healthy in 60 s"
            time.sleep(0.1)
        generated_total = ("infer_generation_tokens_total", ())
        before = parse_prometheus_text(httpx.get(f"{server.base_url}/metrics").text)[generated_total]
        run = asyncio.run(
            run_workload(workload, base_url=server.base_url, model=str(checkpoint), warmup=False)
        )
        after = parse_prometheus_text(httpx.get(f"{server.base_url}/metrics").text)[generated_total]
    assert run.ignore_eos_sent
    for record, request in zip(run.records, workload.requests, strict=True):
        assert record.ok, record.error
        assert record.output_tokens_from == "usage"
        assert record.num_output_tokens == request.max_tokens  # ignore_eos: always the full length
    # The server's own count of generated tokens over the run equals what the client counted.
    assert after - before == sum(record.num_output_tokens for record in run.records)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_against_our_server_that_speculates_chunks_carry_runs_and_acceptance_is_reported(tmp_path):
    """A server with n-gram speculation streams a verified run of tokens in one chunk: the client
    counts a chunk's tokens from its token_ids (they add up to the usage), ITL is per token, and
    the report's acceptance figures are those of a replay of each timed request
    (conformance.spec_decode_replay over the recompute oracle's greedy tokens; concurrency 1, so
    each request is alone in the engine as the replay assumes)."""
    import torch

    from conformance.oracles import RecomputeOracle
    from conformance.spec_decode_replay import ReplayedCounts, replay_ngram
    from infer.bench.serving.workloads import BenchRequest, Workload
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.engine.sampling_params import SamplingParams
    from infer.models.load import load_model
    from infer.models.random_checkpoint import make_random_checkpoint
    from infer.server.app import create_app

    checkpoint = make_random_checkpoint("llama-tiny", tmp_path / "llama-tiny", dtype=torch.float32)
    loaded = load_model(str(checkpoint), dtype=torch.float32, device="cpu")
    oracle = RecomputeOracle(loaded)
    greedy = lambda n: SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)  # noqa: E731
    # Prompts that end with the model's own greedy continuation of a random start: a tiny random
    # model soon repeats itself, so n-gram drafts are often right (and sometimes wrong).
    generator = torch.Generator().manual_seed(3)
    starts = [
        torch.randint(0, loaded.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 12, 19)
    ]
    prompts = [start + oracle.generate(start, greedy(20)).token_ids for start in starts]
    max_tokens = 40
    requests = [BenchRequest(i, max_tokens, prompt) for i, prompt in enumerate(prompts)]
    workload = Workload("looping", 1, 0, requests, WorkloadShape("completion"))
    config = EngineConfig(
        model=str(checkpoint), device="cpu", max_batch_size=2, max_seq_len=160, speculative_config=NGRAM
    )
    with ThreadedServer(create_app(lambda: Engine(config, loaded_model=loaded))) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.base_url}/health").status_code != 200:
            assert time.monotonic() < deadline, "our server did not become healthy in 60 s"
            time.sleep(0.1)
        report = asyncio.run(benchmark_server(workload, base_url=server.base_url, model=str(checkpoint)))
    verdicts = []
    for prompt in prompts:
        verdicts += replay_ngram(
            NGRAM, prompt, oracle.generate(prompt, greedy(max_tokens)).token_ids, max_tokens
        ).verdicts
    expected = ReplayedCounts(tuple(verdicts))
    assert 0 < expected.num_accepted_tokens < expected.num_draft_tokens
    stats = report["stats"]
    assert stats["spec_decode"] == expected.bench_figures(NGRAM["num_speculative_tokens"])
    records = report["records"]
    for record in records:
        assert record["output_tokens_from"] == "usage" and record["num_output_tokens"] == max_tokens
        assert record["chunk_tokens_from"] == "token_ids"
        assert sum(record["chunk_num_tokens"]) == max_tokens
    # Verified runs came in one chunk: fewer chunks than tokens, and ITL counts every token.
    assert stats["tokens_per_chunk"] > 1 and stats["chunk_tokens_from"] == "token_ids"
    assert stats["itl_s"]["count"] == len(records) * (max_tokens - 1)
    assert stats["inter_chunk_s"]["count"] == sum(len(r["chunk_times"]) - 1 for r in records)
    assert stats["inter_chunk_s"]["count"] < stats["itl_s"]["count"]
    markdown = serve_markdown(report)
    assert f"acceptance {100 * expected.num_accepted_tokens / expected.num_draft_tokens:.1f}%" in markdown
    assert "ITL is per token" in markdown


def test_engine_only_runs_the_closed_loop_through_the_engine(tmp_path, monkeypatch):
    """`infer bench engine-only`: every request generates exactly its max_tokens (ignore_eos),
    and no more than `concurrency` are ever in the engine at once."""
    import torch

    from infer.bench.serving import engine_only
    from infer.engine.config import EngineConfig
    from infer.models.random_checkpoint import PRESETS, make_random_checkpoint

    # The tiny preset with room for W2's longest prompt and answer (1024 + 256 tokens).
    checkpoint = make_random_checkpoint("llama-tiny", tmp_path / "llama-tiny", dtype=torch.float32)
    hf_config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**hf_config, "max_position_embeddings": 1300}))
    config_path = tmp_path / "engine.json"
    config = EngineConfig(model=str(checkpoint), device="cpu", max_batch_size=4, max_seq_len=1300)
    config_path.write_text(json.dumps(config.to_dict()))
    vocab = PRESETS["llama-tiny"].config["vocab_size"]
    json_path = tmp_path / "run.json"
    workload = make_workload("W2", concurrency=2, num_requests=3, vocab_size=vocab)
    most_in_flight = []
    real_step = engine_only.Engine.step

    def step(engine, *args, **kwargs):
        most_in_flight.append(engine.stats().num_running + engine.stats().num_waiting)
        return real_step(engine, *args, **kwargs)

    monkeypatch.setattr(engine_only.Engine, "step", step)  # the real step, counted
    status = bench_main([
        "engine-only", "--engine-config", str(config_path), "--workload", "W2", "--concurrency", "2",
        "--num-requests", "3", "--vocab-size", str(vocab), "--repeats", "2", "--json", str(json_path),
    ])  # fmt: skip
    assert status == 0
    report = json.loads(json_path.read_text())
    run, second_run = report["runs"]
    assert run["output_tokens"] == sum(request.max_tokens for request in workload.requests)
    assert run["output_tokens_per_s"] > 0 and run["steps"] >= max(r.max_tokens for r in workload.requests)
    assert max(most_in_flight) <= 2
    # A repeat draws requests of its own (seed 1), so a prefix cache could not serve it from the
    # run before.
    repeat = make_workload("W2", concurrency=2, num_requests=3, vocab_size=vocab, seed=1)
    assert [r.max_tokens for r in repeat.requests] != [r.max_tokens for r in workload.requests]
    assert second_run["output_tokens"] == sum(request.max_tokens for request in repeat.requests)


def test_engine_only_with_speculation_reports_the_engines_acceptance(tmp_path):
    """`infer bench engine-only` on an engine that speculates: each run reports what the
    engine's counters gained over it, which the table shows beside tok/s."""
    import torch

    from infer.bench.serving import engine_only
    from infer.bench.serving.workloads import BenchRequest, Workload
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.random_checkpoint import make_random_checkpoint

    checkpoint = make_random_checkpoint("llama-tiny", tmp_path / "llama-tiny", dtype=torch.float32)
    config = EngineConfig(
        model=str(checkpoint), device="cpu", max_batch_size=2, max_seq_len=160, speculative_config=NGRAM
    )
    engine = Engine(config)
    # A prompt that repeats itself: its n-grams recur, so there are drafts to verify.
    requests = [BenchRequest(i, 24, [5, 6, 7, 8, 9, 10] * (3 + i)) for i in range(3)]
    workload = Workload("repeating", 2, 0, requests, WorkloadShape("completion"))
    engine_only.run_engine_only(engine, workload)  # counted in the engine, not in the next run
    before = engine.stats()
    run = engine_only.run_engine_only(engine, workload)
    after = engine.stats()
    engine.shutdown()
    spec = run["spec_decode"]
    assert (
        spec["verified_rows"]
        == after.spec_decode_num_verified_rows - before.spec_decode_num_verified_rows
        > 0
    )
    assert spec["draft_tokens"] == after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert (
        spec["accepted_tokens"]
        == after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    )
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["verified_rows"])
    table = engine_only.engine_only_markdown(workload, {}, [run]).splitlines()
    assert table[-3].endswith("| accept % | accepted len |")
    assert table[-1].endswith(f"| {100 * spec['acceptance_rate']:.1f} | {spec['mean_accepted_length']:.2f} |")


TINY_CONVERSATION = WorkloadShape(
    "conversation",
    output_tokens=(2, 4),
    system_prompt_words=12,
    user_words=(2, 4),
    turns=(4, 5),
    tool_turn_every=3,
)


def test_a_conversation_sends_each_turn_with_the_replies_so_far():
    """Against the peer (which streams "t0 t1 ..."): turn k's messages are turn k-1's, its reply
    as the assistant's message, and the new turn; every 3rd turn answers a tool call the
    previous reply is taken to have made."""
    workload = make_workload("convo", shape=TINY_CONVERSATION, concurrency=2, num_requests=3)
    app, server = _peer()
    with server:
        run = asyncio.run(run_workload(workload, base_url=server.base_url, model="peer-model", warmup=False))
    bodies = [body for body in app.state.peer["received"] if "messages" in body]
    by_conversation: dict[str, list[list[dict]]] = {}
    for body in bodies:
        first_user = next(m for m in body["messages"] if m["role"] == "user")["content"]
        by_conversation.setdefault(first_user.split(",")[0], []).append(body["messages"])
    assert len(run.records) == sum(len(request.turns) for request in workload.requests) == len(bodies)
    for request in workload.requests:
        turns = by_conversation[f"Conversation {request.index}"]
        assert len(turns) == len(request.turns)
        for turn, (before, after) in enumerate(zip(turns, turns[1:], strict=False), start=1):
            reply = after[len(before)]
            assert after[: len(before)] == before or turn % 3 == 0  # a tool turn edits the last reply
            assert reply["role"] == "assistant" and reply["content"].startswith("t0 ")
            if turn % 3 == 0:
                assert (
                    reply["tool_calls"][0]["id"] == after[-1]["tool_call_id"] and after[-1]["role"] == "tool"
                )
            else:
                assert after[-1]["role"] == "user"
    assert {record.turn for record in run.records} == {0, 1, 2, 3} | (
        {4} if any(len(r.turns) == 5 for r in workload.requests) else set()
    )


def test_a_conversation_against_our_server_reports_cache_hits_on_later_turns(tmp_path):
    """W5's pattern on our server with the prefix cache: every turn after the first reuses the
    conversation so far."""
    import torch

    from infer.bench.serving.stats import prefix_cache_stats
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.random_checkpoint import make_random_checkpoint
    from infer.server.app import create_app

    checkpoint = make_random_checkpoint("llama-tiny", tmp_path / "llama-tiny", dtype=torch.float32)
    # The tiny tokenizer spells words nearly letter by letter: room for a few turns of them.
    hf_config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**hf_config, "max_position_embeddings": 2048}))
    config = EngineConfig(
        model=str(checkpoint), device="cpu", max_batch_size=2, max_seq_len=2048,
        use_chunked_prefill=True, use_prefix_caching=True,
    )  # fmt: skip
    workload = make_workload("convo", shape=TINY_CONVERSATION, concurrency=1, num_requests=1)
    with ThreadedServer(create_app(lambda: Engine(config))) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.base_url}/health").status_code != 200:
            assert time.monotonic() < deadline, "our server did not become healthy in 60 s"
            time.sleep(0.1)
        run = asyncio.run(
            run_workload(workload, base_url=server.base_url, model=str(checkpoint), warmup=False)
        )
    assert all(record.ok for record in run.records), [record.error for record in run.records]
    turns = sorted(run.records, key=lambda record: record.turn)
    assert turns[0].num_cached_tokens == 0
    assert all(record.num_cached_tokens > 0 for record in turns[1:])
    stats = prefix_cache_stats(run.records)
    assert stats["hits"] == len(turns) - 1 and 0 < stats["cached_share"] < 1


# W6 on gemma3-vision-tiny: 4 requests of 32 x 32 images, 16 tokens each.
VISION_ARGS = ["--workload", "W6", "--concurrency", "2", "--num-requests", "4", "--image-size", "32"]
NUM_VISION_REQUESTS = 4


def test_w6_chat_content_goes_out_as_the_workload_wrote_it():
    """Against the peer: each timed body's messages are the request's own, the list of an image
    part and a text part untouched; the warm-up and probe sent images of their own."""
    shape = WorkloadShape("chat", output_tokens=(2, 3), user_words=(2, 3), image_size=16)
    workload = make_workload("W6", shape=shape, concurrency=2, num_requests=3)
    app, server = _peer()
    with server:
        run = asyncio.run(run_workload(workload, base_url=server.base_url, model="peer-model"))
    assert all(record.ok for record in run.records)
    untimed, timed = app.state.peer["received"][:2], app.state.peer["received"][2:]
    assert sorted(json.dumps(body["messages"]) for body in timed) == sorted(
        json.dumps(request.messages) for request in workload.requests
    )
    urls = {json.dumps(request.messages[0]["content"][0]) for request in workload.requests}
    assert not urls & {json.dumps(body["messages"][0]["content"][0]) for body in untimed}


def test_engine_only_second_pass_finds_every_image_the_first_encoded(
    vision_engine_config, tmp_path, monkeypatch
):
    """`infer bench engine-only --passes 2` on W6 with a prefix cache: pass 1 encodes every image
    (the untimed warm-up ran 8 requests of another seed, other images), pass 2 finds each one
    cached. Oracle: the engine's own counters at shutdown against the number of requests."""
    from infer.engine.engine import Engine
    from infer.models.random_checkpoint import PRESETS

    totals = []
    real_shutdown = Engine.shutdown

    def shutdown(engine):
        totals.append(engine.stats())
        real_shutdown(engine)

    monkeypatch.setattr(Engine, "shutdown", shutdown)
    json_path, md_path = tmp_path / "run.json", tmp_path / "run.md"
    status = bench_main([
        "engine-only", "--engine-config", str(vision_engine_config),
        *VISION_ARGS, "--repeats", "1", "--passes", "2", "--json", str(json_path), "--md", str(md_path),
    ])  # fmt: skip
    assert status == 0
    (engine_stats,) = totals
    num_warm_up = 8
    n = NUM_VISION_REQUESTS
    assert engine_stats.vision_encoder_runs == num_warm_up + n
    assert engine_stats.vision_encoder_skipped == n
    first, second = json.loads(json_path.read_text())["runs"]
    assert (first["pass"], second["pass"]) == (1, 2)
    assert (first["vision"]["images_encoded"], first["vision"]["images_skipped"]) == (n, 0)
    assert (second["vision"]["images_encoded"], second["vision"]["images_skipped"]) == (0, n)
    tokens_per_image = PRESETS["gemma3-vision-tiny"].mm_tokens_per_image
    assert second["vision"]["image_tokens_reused"] == n * tokens_per_image
    assert first["vision"]["encoder_s_per_image"] == pytest.approx(first["vision"]["encoder_s"] / n)
    assert first["vision"]["encoder_s"] > 0 and second["vision"]["encoder_s"] == 0
    assert second["ttft_p50_ratio_to_pass_1"] == pytest.approx(second["ttft_p50_ms"] / first["ttft_p50_ms"])
    table = md_path.read_text().splitlines()
    assert table[-4].endswith(
        "| pass | TTFT p50 x pass 1 | images encoded | images skipped | encoder ms/image |"
    )
    assert table[-1].endswith(f"| 2 | {second['ttft_p50_ratio_to_pass_1']:.2f} | 0 | {n} | - |")


def test_serve_second_pass_finds_every_image_the_first_encoded(vision_engine_config, tmp_path):
    """`infer bench serve --passes 2` on W6 against our server with a prefix cache: the figures
    from /metrics say pass 1 encoded every image and pass 2 none. Oracle: the server's /v1/stats
    vision totals (the engine's counts as its stats keep them), against the number of requests
    and the two images of the untimed warm-up and probe."""
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.server.app import create_app

    config = EngineConfig.from_file(vision_engine_config)
    json_path, md_path = tmp_path / "run.json", tmp_path / "run.md"
    with ThreadedServer(create_app(lambda: Engine(config))) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.base_url}/health").status_code != 200:
            assert time.monotonic() < deadline, "our server did not become healthy in 60 s"
            time.sleep(0.1)
        status = bench_main([
            "serve", "--base-url", server.base_url, *VISION_ARGS, "--passes", "2",
            "--json", str(json_path), "--md", str(md_path),
        ])  # fmt: skip
        totals = httpx.get(f"{server.base_url}/v1/stats").json()["vision"]
    assert status == 0
    n = NUM_VISION_REQUESTS
    assert (totals["encoder_runs"], totals["encoder_skipped"]) == (n + 2, n)
    report = json.loads(json_path.read_text())
    (later,) = report["later_passes"]
    first, second = report["stats"]["vision"], later["stats"]["vision"]
    assert (first["images_encoded"], first["images_skipped"]) == (n, 0)
    assert (second["images_encoded"], second["images_skipped"]) == (0, n)
    assert first["encoder_s"] > 0 and second["encoder_s"] == 0
    ttft_p50 = [
        statistics.median(r["ttft_s"] for r in records) for records in (report["records"], later["records"])
    ]
    assert later["pass"] == 2 and later["ttft_p50_ratio_to_pass_1"] == pytest.approx(
        ttft_p50[1] / ttft_p50[0]
    )
    table = md_path.read_text()
    assert "| pass | TTFT p50 x pass 1 | images encoded | images skipped | encoder ms/image |" in table
    assert f"| 2 | {later['ttft_p50_ratio_to_pass_1']:.2f} | 0 | {n} | - |" in table


# W7's pattern, small: a 700-token system prompt (by the estimate; the tools' JSON is most of it),
# tool results of 40-120 words, answers of 60-120 tokens (well above the estimate's allowance for
# a turn's template and call, so that a cap check that forgot an answer would be seen).
TINY_AGENT = WorkloadShape(
    "agent",
    output_tokens=(60, 120),
    user_words=(4, 8),
    system_prompt_tokens=700,
    tool_result_tokens=(40, 120),
    max_context_tokens=2500,
    think_time_s=0.03,
    requests_per_client=1,
)


def _peer_prompt_tokens(body: dict, preamble_tokens: int) -> int:
    """A chat prompt's tokens as the peer counts them (bench_peer.py): its messages' words."""
    return preamble_tokens + sum(len(message["content"].split()) for message in body["messages"])


def test_agent_sessions_resend_the_conversation_pause_and_stop_before_the_cap():
    """W7 against the peer, whose chat template adds 1200 tokens the client cannot see: each turn
    is the previous turn's messages, the peer's reply (taken to have called the turn's tool) and
    the tool result; every turn waits its think time after the previous reply; by the peer's own
    counts no turn's context passes the cap (with the estimate's allowance for a turn's call and
    template), and a session that stops before its planned turns does so because its next turn
    would have passed it."""
    # More than the estimate overcounts by the end of a plan (the JSON's punctuation, the
    # template allowance of each turn), so that sessions meet the cap before their plan ends.
    preamble = 1200
    workload = make_workload("W7", shape=TINY_AGENT, concurrency=6)
    app = bench_peer.create_peer_app(
        first_token_delay_s=0.002, token_delay_s=0.0002, preamble_tokens=preamble
    )
    with ThreadedServer(app) as server:
        run = asyncio.run(run_workload(workload, base_url=server.base_url, model="peer-model", warmup=False))
    assert all(record.ok for record in run.records), [record.error for record in run.records]
    sessions: dict[str, list[dict]] = {}
    for body in app.state.peer["received"]:
        sessions.setdefault(body["messages"][1]["content"], []).append(body)
    cap = TINY_AGENT.max_context_tokens
    stopped_early = 0
    for request in workload.requests:
        bodies = sessions[request.turns[0][1]["content"]]
        assert bodies[0]["messages"] == list(request.turns[0])
        assert [body["max_tokens"] for body in bodies] == list(request.turn_max_tokens[: len(bodies)])
        for turn, (before, after) in enumerate(zip(bodies, bodies[1:], strict=False), start=1):
            (result,) = request.turns[turn]
            reply, tool = after["messages"][len(before["messages"]) :]
            assert after["messages"][: len(before["messages"])] == before["messages"]
            assert reply["content"] == "".join(f"t{i} " for i in range(before["max_tokens"]))
            assert reply["tool_calls"][0]["function"] == result["call"]
            assert tool == {
                "role": "tool",
                "tool_call_id": reply["tool_calls"][0]["id"],
                "content": result["content"],
            }
        # A turn's context as the peer counts it, plus what the client's estimate allows for the
        # turn's call and template wrapping beyond the tool result's words (none for turn 0).
        allowances = [0] + [
            num_tokens - len(result["content"].split())
            for num_tokens, (result,) in zip(request.turn_num_tokens[1:], request.turns[1:], strict=True)
        ]
        for turn, body in enumerate(bodies):
            assert _peer_prompt_tokens(body, preamble) + body["max_tokens"] + allowances[turn] <= cap
        if len(bodies) < len(request.turns):
            stopped_early += 1
            # The next turn: the last prompt, its reply, the tool result, the answer.
            (result,) = request.turns[len(bodies)]
            words = len(result["content"].split())
            allowance = allowances[len(bodies)]
            last = bodies[-1]
            next_context = (
                _peer_prompt_tokens(last, preamble)
                + last["max_tokens"]
                + words
                + request.turn_max_tokens[len(bodies)]
            )
            assert next_context + allowance > cap
    assert stopped_early > 0  # the preamble the plan did not know of made some stop sooner
    by_session = {}
    for record in sorted(run.records, key=lambda record: record.turn):
        by_session.setdefault(record.index, []).append(record)
    for request in workload.requests:
        turns = by_session[request.index]
        assert len(turns) >= 3
        for turn, (before, after) in enumerate(zip(turns, turns[1:], strict=False), start=1):
            assert after.send_time - before.end_time >= request.turn_think_s[turn] - 1e-3  # clock rounding


def test_a_time_cap_cuts_agent_sessions_short_without_waiting_out_their_pauses():
    """Agent sessions of 4 or more planned turns, each pausing 0.15 s before a turn, under a
    0.4 s cap (2 at once, 8 sessions): no turn is sent after the cap; a session stops where its
    next pause would end past the cap, without taking it, so the run ends with the last reply; a
    worker whose session stopped before the cap starts the next session's first turn (which has
    no pause). By what the peer received, the sessions with fewer turns than planned are those
    the result counts as cut short (the peer counts no more tokens than the plan, so none meets
    its context cap), and those it never saw are the ones not started.

    The peer's first-token delay of 0.08 s bounds how many sessions can start, however fast the
    machine: a worker's first session sends its second turn at >= 0.23 s, which ends at >= 0.31 s,
    and each later one-turn session takes >= 0.08 s, so it starts at most 3 sessions by 0.4 s and the
    two workers at most 6 of the 8. No session can finish: its 3 pauses alone pass the cap."""
    think_s, duration_s = 0.15, 0.4
    workload = make_workload("W7", shape=TINY_AGENT, concurrency=2, num_requests=8)
    assert min(len(request.turns) for request in workload.requests) >= 4
    paused = [
        dataclasses.replace(request, turn_think_s=(0.0,) + (think_s,) * (len(request.turns) - 1))
        for request in workload.requests
    ]
    workload = dataclasses.replace(workload, requests=paused)
    app = bench_peer.create_peer_app(first_token_delay_s=0.08, token_delay_s=0.0002)
    with ThreadedServer(app) as server:
        run = asyncio.run(
            run_workload(
                workload, base_url=server.base_url, model="peer-model", warmup=False, duration_s=duration_s
            )
        )
    deadline = run.start_time + duration_s
    assert all(record.ok for record in run.records), [record.error for record in run.records]
    assert all(record.send_time <= deadline + SEND_AFTER_CHECK_S for record in run.records)
    sessions: dict[str, int] = {}
    for body in app.state.peer["received"]:
        sessions[body["messages"][1]["content"]] = sessions.get(body["messages"][1]["content"], 0) + 1
    sent = [sessions.get(request.turns[0][1]["content"], 0) for request in workload.requests]
    assert sum(sent) == len(run.records)
    cut_short = sum(
        1 for request, turns in zip(workload.requests, sent, strict=True) if 0 < turns < len(request.turns)
    )
    not_started = sent.count(0)
    assert cut_short >= 2 and not_started >= 1
    assert run.stopped_by_duration == {"requests_not_started": not_started, "sessions_cut_short": cut_short}
    # Each session stopped for its next pause: its last reply's end plus the pause passes the cap.
    last_ends: dict[int, float] = {}
    for record in run.records:
        last_ends[record.index] = max(last_ends.get(record.index, 0.0), record.end_time)
    assert all(end + think_s > deadline for end in last_ends.values())
    # Nothing waits after the last reply (a session that slept its pause out would end the run
    # 0.15 s after its last reply).
    assert run.end_time - max(last_ends.values()) < think_s / 2
    assert duration_line(run_stats(run), "agent") == (
        f"Stopped at the 0.4 s cap: {not_started} requests not started, {cut_short} sessions cut short"
    )


def test_cli_serve_w7_reports_each_turn_and_the_prefix_cache_matches(tmp_path):
    """`infer bench serve --workload W7` against the peer playing a prefix cache of whole messages:
    every session runs all its planned turns (the peer counts no more tokens than the plan); a
    later turn reuses the previous turn's prompt; the first agent session's first turn was sent
    untimed already (warm-up and probe), so only the second agent session's first turn misses; the
    report's match kinds are what the peer counted over the timed turns."""
    app = bench_peer.create_peer_app(first_token_delay_s=0.002, token_delay_s=0.0002, prefix_cache=True)
    json_path, md_path = tmp_path / "run.json", tmp_path / "run.md"
    with ThreadedServer(app) as server:
        status = bench_main([
            "serve", "--base-url", server.base_url, "--workload", "W7", "--concurrency", "2",
            "--max-context-tokens", "8000", "--think-time-s", "0.01",
            "--json", str(json_path), "--md", str(md_path),
        ])  # fmt: skip
    assert status == 0
    report = json.loads(json_path.read_text())
    assert (report["workload"]["max_context_tokens"], report["workload"]["think_time_s"]) == (8000, 0.01)
    workload = make_workload(
        "W7",
        shape=dataclasses.replace(SHAPES["W7"], max_context_tokens=8000, think_time_s=0.01),
        concurrency=2,
    )
    records = report["records"]
    assert len(records) == report["workload"]["planned_turns"] == sum(len(r.turns) for r in workload.requests)
    prompts = {(record["index"], record["turn"]): record["num_prompt_tokens"] for record in records}
    for record in records:
        if record["turn"] > 0:
            assert record["num_cached_tokens"] == prompts[(record["index"], record["turn"] - 1)]
    first_turns = sorted(
        (record["index"], record["num_cached_tokens"]) for record in records if record["turn"] == 0
    )
    assert first_turns == [(0, prompts[(0, 0)]), (1, 0)]
    stats = report["stats"]
    assert stats["prefix_cache_matches"] == {"miss": 1, "prefix": len(records) - 1, "lcp": 0}
    # And the untimed warm-up (a miss) and probe (a hit on it).
    assert app.state.peer["matches"] == {"miss": 2, "prefix": len(records), "lcp": 0}
    per_turn = stats["turns"]["per_turn"]
    assert [one["requests"] for one in per_turn] == [
        sum(1 for record in records if record["turn"] == turn) for turn in range(len(per_turn))
    ]
    later = [record["ttft_s"] for record in records if record["turn"] >= 2]
    assert later and stats["turns"]["ttft_p50_turns_from_3_s"] == pytest.approx(statistics.median(later))
    markdown = md_path.read_text()
    assert f"TTFT p50 of turns >= 3: {1000 * statistics.median(later):.1f} ms" in markdown
    assert f"interleave, so not per turn): miss 1, prefix {len(records) - 1}, lcp 0" in markdown
    assert (
        "| turn | requests | TTFT p50 (ms) | TTFT p99 (ms) | prompt tokens | computed | reused |" in markdown
    )


def test_agent_sessions_against_our_server_reuse_their_history_within_the_cap(tmp_path):
    """W7's pattern on our server with the prefix cache, on the tiny vocabulary that spells words
    byte by byte (4-5 tokens a word where the plan counts 1): the client scales its estimate by
    what the server counted and ends each session before the cap; every turn reuses cached
    tokens, a later turn at least the previous turn's prompt; none misses; the report's match
    kinds are our server's /metrics over the timed turns, one admission each."""
    import torch

    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.random_checkpoint import make_random_checkpoint
    from infer.server.app import create_app

    max_seq_len = 8192
    checkpoint = make_random_checkpoint("llama-tiny", tmp_path / "llama-tiny", dtype=torch.float32)
    hf_config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**hf_config, "max_position_embeddings": max_seq_len}))
    config = EngineConfig(
        model=str(checkpoint), device="cpu", max_batch_size=2, max_seq_len=max_seq_len,
        use_chunked_prefill=True, use_prefix_caching=True,
    )  # fmt: skip
    cap = 5000
    shape = dataclasses.replace(
        TINY_AGENT,
        output_tokens=(2, 4),
        tool_result_tokens=(10, 30),
        max_context_tokens=cap,
        think_time_s=0.0,
    )
    workload = make_workload("W7", shape=shape, concurrency=2)
    with ThreadedServer(create_app(lambda: Engine(config))) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.base_url}/health").status_code != 200:
            assert time.monotonic() < deadline, "our server did not become healthy in 60 s"
            time.sleep(0.1)
        report = asyncio.run(benchmark_server(workload, base_url=server.base_url, model=str(checkpoint)))
    records = report["records"]
    assert all(record["error"] is None for record in records), [record["error"] for record in records]
    for request in workload.requests:
        turns = sorted((r for r in records if r["index"] == request.index), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == list(range(len(turns)))
        assert 3 <= len(turns) < len(request.turns)  # the plan, at a token a word, was far longer
        contexts = [r["num_prompt_tokens"] + r["num_output_tokens"] for r in turns]
        assert max(contexts) <= cap and contexts[-1] > cap - 400  # a turn here: ~100-250 tokens
        # The first turns share the system prompt the untimed warm-up left; each later turn
        # reuses at least the whole prompt of the turn before it.
        assert turns[0]["num_cached_tokens"] > 0
        for before, after in zip(turns, turns[1:], strict=False):
            assert after["num_cached_tokens"] >= before["num_prompt_tokens"]
    matches = report["stats"]["prefix_cache_matches"]
    assert set(matches) == {"miss", "prefix", "supersequence", "lcp"}
    assert sum(matches.values()) == len(records) and matches["miss"] == 0


def test_cli_serve_caps_the_run_and_says_what_it_left_out(tmp_path, capsys):
    """`--duration-s 0` is refused before any request goes out (nothing listens at the URL); a cap
    of 0.3 s on W2 (requests of 0.3-1.3 s against the peer) reaches the run through the runner:
    the report carries it and counts what it left out, and the markdown says so."""
    assert bench_main(["serve", "--base-url", "http://127.0.0.1:9", "--duration-s", "0"]) == 1
    assert "--duration-s must be > 0, got 0.0" in capsys.readouterr().err
    _, server = _peer()
    json_path, md_path = tmp_path / "run.json", tmp_path / "run.md"
    with server:
        status = bench_main([
            "serve", "--base-url", server.base_url, "--workload", "W2", "--concurrency", "2",
            "--num-requests", "8", "--vocab-size", "50", "--duration-s", "0.3",
            "--json", str(json_path), "--md", str(md_path),
        ])  # fmt: skip
    assert status == 0
    report = json.loads(json_path.read_text())
    stats = report["stats"]
    not_started = 8 - len(report["records"])
    assert not_started > 0 and stats["num_ok"] == len(report["records"])
    assert stats["duration_s"] == 0.3
    assert stats["stopped_by_duration"] == {"requests_not_started": not_started, "sessions_cut_short": 0}
    assert f"Stopped at the 0.3 s cap: {not_started} requests not started\n" in md_path.read_text()


def test_a_time_cap_must_be_positive():
    workload = make_workload("tiny", shape=TINY_COMPLETIONS, concurrency=1, num_requests=1, vocab_size=100)
    with pytest.raises(ValueError, match="duration_s must be > 0"):
        asyncio.run(run_workload(workload, base_url="http://127.0.0.1:9", model="m", duration_s=0))
