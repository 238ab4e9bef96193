"""`infer serve` on a CPU runs the default model's own GGUF file (infer.server.cpu_weights), and
`--quantization none` the dense checkpoint.

Oracle: engines built in this process on the same folder, one with quantization "gguf" (whose
packed products are checked against the dequantized model in infer-engine's test_gguf_cpu.py) and
one dense (checked against transformers elsewhere). The served greedy tokens' logprobs must be the
one engine's, not the other's: the two differ by far more than a run differs from itself."""

import openai
import pytest

from infer.engine import Engine, EngineConfig, SamplingParams
from infer.kernels import gguf_linear_cpu_native
from infer.models import DEFAULT_MODEL
from infer.server.cpu_weights import default_cpu_weights

from .test_engine_process import start_infer_serve, wait_healthy

PROMPT = "The three largest cities of France are"
TOKENS = 8
# One served run against one in-process run of the same weights and kernels (float32).
SAME_ATOL = 1e-4
# The packed model rounds x to int8 blocks as llama.cpp does: its logprobs move by far more.
APART_AT_LEAST = 1e-2

needs_c_kernels = pytest.mark.skipif(
    not gguf_linear_cpu_native(), reason="the GGUF C kernel does not build here"
)


def engine_logprobs(quantization: str | None) -> list[float]:
    """The greedy tokens' logprobs of an in-process engine on the default model."""
    config = EngineConfig(model=DEFAULT_MODEL, device="cpu", max_seq_len=256, max_batch_size=2)
    engine = Engine(config.replace(quantization=quantization))
    try:
        ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
        params = SamplingParams(temperature=0, max_new_tokens=TOKENS, ignore_eos=True, logprobs=0)
        engine.add_request(ids, params)
        logprobs = []
        while engine.has_work():
            logprobs += [out.logprobs.logprob for out in engine.step() if out.token_id is not None]
        return logprobs
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def oracle() -> dict[str, list[float]]:
    return {"gguf": engine_logprobs("gguf"), "dense": engine_logprobs(None)}


def served_logprobs(*flags: str) -> list[float]:
    process, base_url = start_infer_serve("--device", "cpu", *flags)
    try:
        wait_healthy(process, base_url)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused")
        choice = client.completions.create(
            model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True},
        ).choices[0]  # fmt: skip
        return choice.logprobs.token_logprobs
    finally:
        process.terminate()
        process.wait(timeout=60)


@needs_c_kernels
@pytest.mark.parametrize(
    ("flags", "runs", "not_runs"), [((), "gguf", "dense"), (("--quantization", "none"), "dense", "gguf")]
)
def test_infer_serve_on_a_cpu_runs_the_gguf_file_unless_told_none(oracle, flags, runs, not_runs):
    served = served_logprobs(*flags)
    assert served == pytest.approx(oracle[runs], abs=SAME_ATOL)
    assert max(abs(a - b) for a, b in zip(served, oracle[not_runs], strict=True)) > APART_AT_LEAST


@needs_c_kernels
def test_the_gguf_default_is_only_for_a_cpu_and_weights_nobody_chose():
    cpu = EngineConfig(model=DEFAULT_MODEL, device="cpu")
    assert default_cpu_weights(cpu).quantization == "gguf"
    kept = [
        cpu.replace(dtype="bfloat16"),
        cpu.replace(quantization="int8"),
        cpu.replace(use_native_cpu_kernels=False),
        cpu.replace(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
        EngineConfig(model=DEFAULT_MODEL, device="cuda"),
        EngineConfig(model="gemma-3-270m", device="cpu"),  # converted from a GGUF file, not a Llama
    ]
    for config in kept:
        assert default_cpu_weights(config) == config, config
