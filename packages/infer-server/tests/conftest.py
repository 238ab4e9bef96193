import httpx
import openai
import pytest


@pytest.fixture
def openai_client_answering():
    """An `openai.OpenAI` client whose every HTTP request gets `respond(request) -> httpx.Response`.

    The real client parses what our code produced (bodies, SSE streams, errors) as it would from a
    server; only the network is left out. No retries, so a 503 reaches the test.
    """

    def make(respond) -> openai.OpenAI:
        transport = httpx.MockTransport(respond)
        return openai.OpenAI(
            api_key="unused",
            base_url="http://infer.test/v1",
            max_retries=0,
            http_client=httpx.Client(transport=transport),
        )

    return make


# -- a real server on 127.0.0.1, for the test_app_* and test_stress tests -----------------------

SERVED_MODEL = "smollm2-135m-instruct"


class RunningServer:
    """Our app on uvicorn in a thread (infer.server.serve.BackgroundServer), on a free port of
    127.0.0.1, healthy once built; `engine` is the Engine it serves."""

    def __init__(self, engine, *, drain_timeout_s: float = 30.0, limits=None):
        from infer.server.serve import BackgroundServer

        self.engine = engine
        self.model = SERVED_MODEL
        self.background = BackgroundServer(
            engine,
            served_model_name=SERVED_MODEL,
            drain_timeout_s=drain_timeout_s,
            log_level="warning",
            limits=limits,
        )
        self.server, self.state = self.background.server, self.background.state
        self.port, self.base_url = self.background.port, self.background.base_url

    def openai_client(self) -> openai.OpenAI:
        return openai.OpenAI(api_key="unused", base_url=f"{self.base_url}/v1", max_retries=0, timeout=60.0)

    def stop(self) -> None:
        self.background.stop()


@pytest.fixture(scope="session")
def smollm2_loaded():
    import torch

    from infer.models.load import load_model

    return load_model(SERVED_MODEL, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_loaded):
    """transformers' model on the same folder (float32, eager attention): the oracle that our
    logits, logprobs and sampling settings are checked against."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_loaded.path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def make_engine(smollm2_loaded):
    """make_engine(**EngineConfig fields) -> an Engine on the session's SmolLM2 (loaded once)."""
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine

    def make(**config):
        # A 512-token context keeps the KV pool small; SmolLM2 itself takes 8192.
        config = {"model": SERVED_MODEL, "max_seq_len": 512, **config}
        return Engine(EngineConfig(**config), loaded_model=smollm2_loaded)

    return make


@pytest.fixture(scope="session")
def spawn_engine():
    """spawn_engine(client_options=None, **EngineConfig fields) -> an Engine whose core runs in a
    child process of its own (`Engine.spawn`, `infer serve`'s default), which loads SmolLM2
    there; `client_options` go to its ProcClient."""
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine

    def spawn(*, client_options: dict | None = None, **config):
        config = {"model": SERVED_MODEL, "max_seq_len": 512, **config}
        return Engine.spawn(EngineConfig(**config), **(client_options or {}))

    return spawn


@pytest.fixture(scope="session")
def start_server(make_engine, spawn_engine):
    """start_server(drain_timeout_s=..., limits=..., engine_process=False, **EngineConfig fields)
    -> a RunningServer, healthy; stopped at the end of the session unless the test stops it
    first. `engine_process`: the engine core in a child process (as `infer serve` runs it), not
    in the server's process."""
    started = []

    def start(*, drain_timeout_s: float = 30.0, limits=None, engine_process: bool = False, **config):
        engine = spawn_engine(**config) if engine_process else make_engine(**config)
        running = RunningServer(engine, drain_timeout_s=drain_timeout_s, limits=limits)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture(scope="session")
def server(start_server):
    """The shared server: 4 rows, the default continuous batching on the paged pool."""
    return start_server(max_batch_size=4)


@pytest.fixture(scope="module")
def small_limits_server(start_server):
    """A server of the test module's own with tight request limits: 2000 bytes of body, 100
    characters of prompt (test_app_errors, test_app_tokenize)."""
    from infer.server.limits import RequestLimits

    running = start_server(
        max_batch_size=1, limits=RequestLimits(max_request_bytes=2000, max_prompt_chars=100)
    )
    yield running
    running.stop()
