"""Several models in one server (infer.server.served_models), on real uvicorn servers on
127.0.0.1 with the official `openai` client: SmolLM2 (the default model) and a tiny random
Llama. A request naming each is answered by that one, as a server of that model alone answers
it (the oracle); with `max_loaded_models=1` they swap, and the unloaded model's prefix cache is
gone (`cached_tokens`); an idle model is unloaded and loaded again by its next request; requests
for both at once all finish while the server swaps. Engines run in this process (factories, as
`infer serve --engine-in-process` builds them), SmolLM2's weights loaded once per session."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.models.random_checkpoint import make_random_checkpoint
from infer.server.errors import ApiError
from infer.server.serve import BackgroundServer

from .conftest import SERVED_MODEL

TINY = "llama-tiny"
# Long enough that a repeated prompt has whole KV blocks for the prefix cache to serve.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
GREEDY = dict(temperature=0, max_tokens=4)
IDLE_UNLOAD_S = 4.0
CACHED = dict(use_chunked_prefill=True, use_prefix_caching=True)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return make_random_checkpoint(TINY, tmp_path_factory.mktemp(TINY), dtype=torch.float32)


@pytest.fixture(scope="module")
def factories(smollm2_loaded, tiny_checkpoint):
    """{served name: a factory of its engine}: SmolLM2 over the session's weights, the tiny
    Llama from its folder."""

    def smollm2():
        config = EngineConfig(model=SERVED_MODEL, max_seq_len=512, max_batch_size=4, **CACHED)
        return Engine(config, loaded_model=smollm2_loaded)

    def tiny():
        return Engine(EngineConfig(model=str(tiny_checkpoint), max_seq_len=256, max_batch_size=4, **CACHED))

    return {SERVED_MODEL: smollm2, TINY: tiny}


def started(models, **options) -> BackgroundServer:
    return BackgroundServer(models, log_level="warning", **options)


@pytest.fixture(scope="module")
def both_server(factories):
    """Both models resident (the default: every model loaded at the start, for good)."""
    server = started(factories)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def swapping_server(factories):
    """One model resident at a time, and a model idle for IDLE_UNLOAD_S unloaded."""
    server = started(factories, max_loaded_models=1, idle_unload_s=IDLE_UNLOAD_S)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oracle_texts(factories, server):
    """What a server of one model answers, by model: the session's SmolLM2 server, and a server
    of the tiny Llama alone."""
    tiny_alone = started(factories[TINY](), served_model_name=TINY)
    try:
        return {
            SERVED_MODEL: complete(server.base_url, SERVED_MODEL).choices[0].text,
            TINY: complete(tiny_alone.base_url, TINY).choices[0].text,
        }
    finally:
        tiny_alone.stop()


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{base_url}/v1", max_retries=0, timeout=120.0)


def complete(base_url: str, model: str, prompt: str = PROMPT):
    return client(base_url).completions.create(model=model, prompt=prompt, **GREEDY)


def states(base_url: str) -> dict[str, str]:
    return {model.id: model.model_extra["state"] for model in client(base_url).models.list()}


def cached_tokens(answer) -> int:
    return answer.usage.prompt_tokens_details.cached_tokens


# -- both resident ---------------------------------------------------------------------------------


def test_a_request_naming_each_model_is_answered_by_that_model(both_server, oracle_texts):
    assert oracle_texts[SERVED_MODEL] != oracle_texts[TINY], "the oracle cannot tell the models apart"
    for model in (SERVED_MODEL, TINY, SERVED_MODEL):
        answer = complete(both_server.base_url, model)
        assert answer.model == model
        assert answer.choices[0].text == oracle_texts[model], f"{model} answered as another model"


def test_a_chat_naming_each_model_uses_that_models_tokenizer(both_server, factories):
    """The prompt is tokenized by the model the request names: usage counts as /tokenize of that
    model counts, and the two vocabularies count the same text differently."""
    counts = {}
    for model in (SERVED_MODEL, TINY):
        messages = [{"role": "user", "content": "Hello there, how are you?"}]
        answer = client(both_server.base_url).chat.completions.create(
            model=model, messages=messages, max_tokens=1
        )
        tokenized = httpx.post(
            f"{both_server.base_url}/tokenize", json={"model": model, "messages": messages}, timeout=60
        ).json()
        assert answer.usage.prompt_tokens == tokenized["count"]
        counts[model] = tokenized["count"]
    assert counts[SERVED_MODEL] != counts[TINY]


def test_models_lists_both_loaded_with_openai_fields(both_server):
    models = list(client(both_server.base_url).models.list())
    assert [model.id for model in models] == [SERVED_MODEL, TINY]
    assert {model.object for model in models} == {"model"}
    assert [model.model_extra["state"] for model in models] == ["loaded", "loaded"]
    assert [model.model_extra["max_model_len"] for model in models] == [512, 256]
    assert client(both_server.base_url).models.retrieve(TINY).id == TINY


def test_health_reports_each_model(both_server):
    health = httpx.get(f"{both_server.base_url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "models": {SERVED_MODEL: "loaded", TINY: "loaded"}}


def test_an_unknown_model_is_404_naming_the_served_ones(both_server):
    with pytest.raises(openai.NotFoundError) as error:
        complete(both_server.base_url, "gpt-4o")
    assert SERVED_MODEL in str(error.value) and TINY in str(error.value)


def test_tokenize_without_a_model_uses_the_first(both_server):
    def count(**model):
        body = {"prompt": "Hello there, how are you?", **model}
        return httpx.post(f"{both_server.base_url}/tokenize", json=body, timeout=60).json()["count"]

    assert count() == count(model=SERVED_MODEL) != count(model=TINY)


def test_metrics_label_each_models_samples(both_server):
    complete(both_server.base_url, TINY)
    text = httpx.get(f"{both_server.base_url}/metrics", timeout=10).text
    assert f'infer_generation_tokens_total{{model="{TINY}"}}' in text
    assert f'infer_requests_running{{model="{SERVED_MODEL}"}}' in text
    assert text.count("# TYPE infer_generation_tokens_total counter") == 1
    assert 'infer_requests_by_status_total{status="200"}' in text  # the server's, unlabelled


def test_stats_are_per_model(both_server):
    answer = complete(both_server.base_url, TINY)
    url = f"{both_server.base_url}/v1/stats"
    tiny = httpx.get(url, params={"model": TINY}, timeout=10).json()
    default = httpx.get(url, timeout=10).json()
    assert (tiny["model"], default["model"]) == (TINY, SERVED_MODEL)
    assert default["models"] == [SERVED_MODEL, TINY]
    assert answer.id in {record["request_id"] for record in tiny["requests"]}
    assert answer.id not in {record["request_id"] for record in default["requests"]}


# -- one resident at a time --------------------------------------------------------------------------


def test_swapping_drops_the_unloaded_models_prefix_cache(swapping_server, oracle_texts):
    url = swapping_server.base_url
    first = complete(url, SERVED_MODEL)
    again = complete(url, SERVED_MODEL)
    assert cached_tokens(again) > 0, "the repeated prompt was not served from the prefix cache"
    assert complete(url, TINY).choices[0].text == oracle_texts[TINY]
    assert states(url) == {SERVED_MODEL: "unloaded", TINY: "loaded"}
    after_swap = complete(url, SERVED_MODEL)
    assert states(url) == {SERVED_MODEL: "loaded", TINY: "unloaded"}
    assert cached_tokens(after_swap) == 0, "the unloaded model's prefix cache survived its unload"
    assert first.choices[0].text == again.choices[0].text == after_swap.choices[0].text
    assert after_swap.choices[0].text == oracle_texts[SERVED_MODEL]


def test_an_idle_model_is_unloaded_and_its_next_request_loads_it(swapping_server, oracle_texts):
    url = swapping_server.base_url
    complete(url, TINY)
    assert states(url)[TINY] == "loaded"
    deadline = time.monotonic() + IDLE_UNLOAD_S + 30
    while states(url)[TINY] != "unloaded":
        assert time.monotonic() < deadline, f"{TINY} still {states(url)[TINY]} long after its idle time"
        time.sleep(0.25)
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["models"] == {SERVED_MODEL: "unloaded", TINY: "unloaded"}
    assert complete(url, TINY).choices[0].text == oracle_texts[TINY]
    assert states(url)[TINY] == "loaded"


def test_requests_for_both_models_at_once_all_finish_while_swapping(swapping_server, oracle_texts):
    url = swapping_server.base_url
    models = [SERVED_MODEL, TINY] * 3
    loads_before = sum(model.num_loads for model in swapping_server.state.models.models)
    with ThreadPoolExecutor(len(models)) as pool:
        answers = list(pool.map(lambda model: complete(url, model), models))
    for model, answer in zip(models, answers, strict=True):
        assert answer.choices[0].text == oracle_texts[model], f"a request for {model}"
    loads = sum(model.num_loads for model in swapping_server.state.models.models) - loads_before
    assert loads >= 1, "the server never swapped"


def test_one_model_unloaded_when_idle_keeps_its_name_and_metrics(factories, tiny_checkpoint):
    """A server of one model (named by its engine) with idle unloading: the model keeps its name
    while unloaded, its next request reloads it, and /metrics counts on across the reload."""
    server = started(factories[TINY], idle_unload_s=1.0)
    try:
        name = str(tiny_checkpoint)
        complete(server.base_url, name)
        deadline = time.monotonic() + 30
        while states(server.base_url) != {name: "unloaded"}:
            assert time.monotonic() < deadline, f"not unloaded: {states(server.base_url)}"
            time.sleep(0.2)
        assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ok"}
        assert complete(server.base_url, name).usage.completion_tokens == GREEDY["max_tokens"]
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        generated = 2 * GREEDY["max_tokens"]
        assert f"infer_generation_tokens_total {float(generated)!r}" in metrics.splitlines()
    finally:
        server.stop()


# -- the wait bound, on the models themselves ---------------------------------------------------------


def test_a_request_waits_at_most_the_bound_for_a_busy_slot(factories):
    """With the one slot held by a request in flight, a request for the other model gets 503
    once the wait passes, and is served as soon as the slot is given back; once the server
    drains, a request for a model not loaded gets 503 at once."""
    from infer.server.limits import RequestLimits
    from infer.server.media import MediaPolicy
    from infer.server.metrics import ServerMetrics
    from infer.server.served_models import ServedModel, ServedModels
    from infer.server.stats import ServerStats

    def served(name):
        return ServedModel(
            name,
            factories[name],
            limits=RequestLimits(),
            media_policy=MediaPolicy(),
            metrics=ServerMetrics(),
            stats=ServerStats(),
        )

    async def scenario():
        models = ServedModels([served(TINY), served(SERVED_MODEL)], max_loaded=1, wait_timeout_s=0.5)
        await models.load_initial()
        try:
            busy_scope, waiting_scope = {}, {}
            tiny = await models.acquire(busy_scope, TINY)
            started_s = time.monotonic()
            with pytest.raises(ApiError) as error:
                await models.acquire(waiting_scope, SERVED_MODEL)
            waited_s = time.monotonic() - started_s
            assert error.value.status == 503 and error.value.code == "model_not_ready"
            assert 0.5 <= waited_s < 5, f"waited {waited_s:.1f} s for a 0.5 s bound"
            assert tiny.state == "loaded", "the model in use was unloaded"
            models.release(tiny)
            models.wait_timeout_s = 120.0  # an unload and a load now, on a busy machine
            default = await models.acquire(waiting_scope, SERVED_MODEL)
            assert (default.state, tiny.state) == ("loaded", "unloaded")
            models.accepting = False  # the server drains: a request still to load its model stops
            with pytest.raises(ApiError) as error:
                await models.acquire({}, TINY)
            assert (error.value.status, error.value.code) == (503, "server_draining")
        finally:
            models.stop()

    asyncio.run(scenario())


# -- the command line ----------------------------------------------------------------------------------


def test_infer_serve_serves_each_repeated_model(tiny_checkpoint, tmp_path_factory):
    """The real `infer serve --model A --model B --max-loaded-models 1`: both listed, the first
    loaded at start, a request for the second answered by loading it in the first's place."""
    import subprocess
    import sys

    from infer.models.tensor_parallel import free_local_port

    qwen = make_random_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"), dtype=torch.float32)
    names = [str(tiny_checkpoint), str(qwen)]
    port = free_local_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "infer.server.cli", "serve", "--model", names[0], "--model", names[1]]
    command += ["--max-loaded-models", "1", "--port", str(port), "--engine-in-process"]
    command += ["--max-seq-len", "256", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert process.poll() is None, f"infer serve exited with {process.returncode}"
            assert time.monotonic() < deadline, "infer serve did not become healthy in 120 s"
            time.sleep(0.1)
        assert states(url) == {names[0]: "loaded", names[1]: "unloaded"}
        answer = client(url).completions.create(model=names[1], prompt="Hello", max_tokens=2)
        assert answer.model == names[1] and answer.usage.completion_tokens == 2
        assert states(url) == {names[0]: "unloaded", names[1]: "loaded"}
    finally:
        process.terminate()
        process.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--served-model-name", "x"], "--served-model-name names the one model"),
        (["--data-parallel-size", "2"], "--data-parallel-size and --nnodes above 1 serve one model"),
        (["--max-loaded-models", "0"], "--max-loaded-models must be >= 1, got 0"),
    ],
    ids=["served-model-name", "data-parallel", "max-loaded-0"],
)
def test_infer_serve_refuses_what_several_models_cannot_do_by_name(tiny_checkpoint, flags, message, capsys):
    from infer.server.cli import serve_main

    models = ["--model", SERVED_MODEL, "--model", str(tiny_checkpoint)]
    assert serve_main([*models, "--device", "cpu", *flags]) == 2
    assert capsys.readouterr().err.startswith(f"infer serve: {message}")


def test_infer_serve_refuses_a_model_named_twice(capsys):
    from infer.server.cli import serve_main

    assert serve_main(["--model", SERVED_MODEL, "--model", SERVED_MODEL]) == 2
    assert capsys.readouterr().err.startswith(f"infer serve: --model {SERVED_MODEL} is given twice")
