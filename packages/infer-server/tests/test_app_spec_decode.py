"""Speculative decoding's figures on a real server (SmolLM2 on CPU, n-gram drafts): after a
greedy request that copies a passage, GET /metrics (read by prometheus_client's parser) and
GET /v1/stats hold the counts that a replay of the request gives (conformance.spec_decode_replay:
the n-gram proposer over the prompt and the greedy tokens of the recompute oracle), and the
scheduler's own. A server that does not speculate shows none of them, as vLLM's."""

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conformance.oracles import RecomputeOracle
from conformance.spec_decode_replay import replay_ngram
from infer.engine import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PASSAGE = (
    "The old lighthouse on the northern cape was built from grey granite quarried a few miles "
    "inland. Its walls are thick at the base and narrow toward the lantern room, where a large "
    "glass lens once turned slowly through the night."
)
# A passage, then the start of its copy: the model goes on copying, which n-gram drafts predict,
# and past the passage it writes on, which they do not.
PROMPT = f"{PASSAGE}\n\nThe same text again, word for word:\n\nThe old lighthouse"
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def spec_server(start_server):
    return start_server(max_batch_size=2, speculative_config=NGRAM)


def samples_of(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_for_records(client: httpx.Client, count: int) -> dict:
    deadline = time.monotonic() + 60
    while len((snapshot := client.get("/v1/stats").json())["requests"]) < count:
        assert time.monotonic() < deadline, "the request's record never came"
        time.sleep(0.05)
    return snapshot


def test_metrics_and_stats_count_what_the_replayed_drafts_predict(spec_server, smollm2_loaded):
    prompt_ids = smollm2_loaded.tokenizer.encode(PROMPT, add_special_tokens=True)
    params = SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    body = {"model": spec_server.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(base_url=spec_server.base_url, timeout=120.0) as client:
        answer = client.post("/v1/completions", json=body).json()
        snapshot = wait_for_records(client, 1)
        samples = samples_of(client.get("/metrics").text)
    # The oracle checks the answer's tokens in one forward (RecomputeOracle.generate's proposal).
    proposal = answer["choices"][0]["token_ids"]
    expected = RecomputeOracle(smollm2_loaded).generate(prompt_ids, params, proposal=proposal)
    assert answer["choices"][0]["text"] == expected.text  # greedy unchanged by speculation
    replayed = replay_ngram(NGRAM, prompt_ids, expected.token_ids, MAX_TOKENS)
    assert 0 < replayed.num_accepted_tokens < replayed.num_draft_tokens  # both verdicts happened

    def metric(name: str, **labels) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert metric("infer_spec_decode_drafts_total") == replayed.num_verified_rows
    assert metric("infer_spec_decode_draft_tokens_total") == replayed.num_draft_tokens
    assert metric("infer_spec_decode_accepted_tokens_total") == replayed.num_accepted_tokens
    K = NGRAM["num_speculative_tokens"]
    padded = lambda counts: [*counts, *[0] * (K - len(counts))]  # noqa: E731
    for name, counts in (
        ("infer_spec_decode_accepted_tokens_per_pos_total", replayed.accepted_by_position),
        ("infer_spec_decode_draft_tokens_per_pos_total", replayed.drafted_by_position),
    ):
        assert [metric(name, position=str(j)) for j in range(K)] == padded(counts), name
    rows, accepted = replayed.num_verified_rows, replayed.num_accepted_tokens
    assert snapshot["spec_decode"] == {
        "num_speculative_tokens": K,
        "verified_rows": rows,
        "draft_tokens": replayed.num_draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": pytest.approx(accepted / replayed.num_draft_tokens),
        "mean_accepted_length": pytest.approx(1 + accepted / rows),
        "accepted_by_position": padded(replayed.accepted_by_position),
        "drafted_by_position": padded(replayed.drafted_by_position),
        "acceptance_rate_by_position": pytest.approx(
            [c / rows for c in padded(replayed.accepted_by_position)]
        ),
    }
    # The scheduler's own counts say the same (the engine runs in this process).
    counts = spec_server.engine.core.scheduler.spec_decode_counts
    assert (counts.num_verified_rows, counts.num_accepted_tokens) == (rows, accepted)
    # Each second's acceptance, over the seconds that verified drafts, adds up to the whole.
    history = snapshot["history"]
    assert (
        1
        <= len(history["spec_decode_acceptance_percent"])
        == len(history["spec_decode_mean_accepted_length"])
    )


def test_a_server_that_does_not_speculate_shows_no_spec_decode_figures(server):
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        snapshot = client.get("/v1/stats").json()
        names = {name for name, _ in samples_of(client.get("/metrics").text)}
    assert snapshot["spec_decode"] is None and snapshot["history"]["spec_decode_acceptance_percent"] == []
    assert not {name for name in names if name.startswith("infer_spec_decode")}


def test_a_streamed_run_of_accepted_tokens_is_one_event_and_itl_stays_per_token(spec_server):
    """A verified run reaches the client as one chunk whose token_ids hold it all; the server's
    inter-token latency histogram observes each token, a run's gap shared among its tokens (so
    none is ~0: a CPU step of SmolLM2 takes milliseconds), and its observations add up to the time
    between the first token's chunk and the last's, as the client saw them."""
    body = {"model": spec_server.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(base_url=spec_server.base_url, timeout=120.0) as client:
        before = samples_of(client.get("/metrics").text)
        chunks = []  # (arrival, tokens in the chunk)
        with client.stream("POST", "/v1/completions", json=body) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    choice = json.loads(line[len("data:") :])["choices"][0]
                    if choice["text"]:
                        chunks.append((time.perf_counter(), len(choice["token_ids"])))
        after = samples_of(client.get("/metrics").text)

    def gained(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    tokens = [num_tokens for _, num_tokens in chunks]
    assert sum(tokens) == MAX_TOKENS and max(tokens) > 1  # some chunk carried a verified run
    assert gained("infer_inter_token_latency_seconds_count") == MAX_TOKENS - 1
    assert gained("infer_inter_token_latency_seconds_bucket", le="0.001") == 0
    client_span = chunks[-1][0] - chunks[0][0]
    assert gained("infer_inter_token_latency_seconds_sum") == pytest.approx(
        client_span, abs=0.05 + 0.1 * client_span
    )
