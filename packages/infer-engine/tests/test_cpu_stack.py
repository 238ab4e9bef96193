"""CPU decode steps through the C decoder stack (infer.models.cpu_stack, the runner's CPU decode
backend, on by default with use_native_cpu_kernels) against the same engine with the backend
taken off its runner: the PyTorch path with the same C kernels for attention and int8 products,
so the same arithmetic up to summation order. The same greedy tokens, and their logprobs within ATOL.

Tiny Llama, Qwen 3 and Gemma 3 checkpoints, float32 and int8 at load, three requests at once
(steps of one to three decode rows, and steps that mix a prompt in, which the stack leaves to the
PyTorch path), and the real SmolLM2 and Gemma 3 270M.
"""

import pytest
import torch

from conformance.memory_maps import advised_huge
from infer.engine import Engine, EngineConfig, SamplingParams
from infer.kernels import DecoderStackCpu
from infer.models.huge_pages import MOVED, huge_pages_unavailable
from infer.models.load import load_model

from .conftest import TINY_PRESETS

pytestmark = pytest.mark.skipif(not DecoderStackCpu.runs_here(), reason="the C kernels do not build here")

PROMPTS = [[5, 91, 200, 17, 300, 42, 7], [11, 12, 13], list(range(40, 80))]


def engine_over(loaded, quantization: str | None, *, stack: bool) -> Engine:
    """An engine over `loaded` (a LoadedModel of that quantization); the two engines a test
    compares share one: the same weights, loaded once."""
    config = EngineConfig(
        model=str(loaded.path), device="cpu", max_seq_len=256, max_batch_size=4, quantization=quantization
    )
    engine = Engine(config, loaded_model=loaded)
    assert engine.core.runner.cpu_decode is not None, "the model does not fit the stack"
    if not stack:
        engine.core.runner.cpu_decode = None  # the PyTorch path for every step
    return engine


def stack_steps(engine: Engine) -> int:
    return engine.core.runner.cpu_decode.num_steps


def requests_at_once(
    engine: Engine, params: SamplingParams, prompts=PROMPTS
) -> list[list[tuple[int, float]]]:
    """Each request's (token, logprob) pairs."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    tokens = {request_id: [] for request_id in ids}
    while engine.has_work():
        for output in engine.step():
            if output.token_id is not None:
                tokens[output.request_id].append((output.token_id, output.logprobs.logprob))
    return [tokens[request_id] for request_id in ids]


# Logprobs: float32 differs by summation order; int8 also by each product's rounding of x to
# int16, which a different last bit of x can move by a step.
ATOL = {None: 2e-4, "int8": 5e-3}


def assert_same(ours: list[tuple[int, float]], theirs: list[tuple[int, float]], quantization) -> None:
    assert [token for token, _ in ours] == [token for token, _ in theirs]
    torch.testing.assert_close(
        torch.tensor([logprob for _, logprob in ours]), torch.tensor([logprob for _, logprob in theirs]),
        rtol=0, atol=ATOL[quantization],
    )  # fmt: skip


@pytest.mark.parametrize("quantization", [None, "int8"], ids=["float32", "int8"])
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_decode_steps_through_the_stack_match_the_pytorch_path(preset, quantization, tiny_checkpoints):
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, logprobs=0)
    loaded = load_model(tiny_checkpoints[preset], dtype=torch.float32, quantization=quantization)
    with_stack = engine_over(loaded, quantization, stack=True)
    ours = requests_at_once(with_stack, params)
    assert stack_steps(with_stack) > 0, "the stack did not run"
    theirs = requests_at_once(engine_over(loaded, quantization, stack=False), params)
    assert [len(t) for t in ours] == [20, 20, 20]
    for request_ours, request_theirs in zip(ours, theirs, strict=True):
        assert_same(request_ours, request_theirs, quantization)


@pytest.mark.parametrize(
    ("fixture", "quantization"), [("smollm2", None), ("smollm2", "int8"), ("gemma3", None)], ids=str
)
def test_the_real_models_decode_the_same_through_the_stack(fixture, quantization, request):
    """The real checkpoints: SmolLM2 (the default) and Gemma 3 270M, whose sliding-window and
    global layers take their own rotary tables (gemma3-tiny's random weights leave its tokens
    blind to a wrong rotation)."""
    model = request.getfixturevalue(fixture)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, logprobs=0)
    prompt = model.loaded.tokenizer.encode(
        "The capital of France is Paris. It is known for", add_special_tokens=True
    )
    # The session's float32 model as it is; int8 is a load of its own.
    folder = model.loaded.path
    loaded = (
        model.loaded
        if quantization is None
        else load_model(folder, dtype=torch.float32, quantization=quantization)
    )
    with_stack = engine_over(loaded, quantization, stack=True)
    [ours] = requests_at_once(with_stack, params, [prompt])
    assert stack_steps(with_stack) > 0
    [theirs] = requests_at_once(engine_over(loaded, quantization, stack=False), params, [prompt])
    assert len(ours) == 24
    assert_same(ours, theirs, quantization)


def test_without_the_native_cpu_kernels_the_runner_has_no_stack(tiny_checkpoints):
    folder = tiny_checkpoints[TINY_PRESETS[0]]
    loaded = load_model(folder, dtype=torch.float32)
    config = EngineConfig(model=str(folder), device="cpu", max_seq_len=64, use_native_cpu_kernels=False)
    engine = Engine(config, loaded_model=loaded)
    assert engine.core.runner.cpu_decode is None
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, logprobs=0)
    assert [len(tokens) for tokens in requests_at_once(engine, params, PROMPTS[:1])] == [3]


@pytest.mark.skipif(huge_pages_unavailable() is not None, reason=str(huge_pages_unavailable()))
def test_the_stack_reads_its_weights_from_huge_pages_unless_turned_off(tiny_checkpoints):
    """use_huge_pages (the default) moves the weights before the runner builds the stack, so the
    stack's own weights lie in a mapping advised MADV_HUGEPAGE (by /proc/self/smaps); turned off,
    no weight is moved (none carries the move's mark). Both decode the same tokens, with the same
    logprobs. (Not "none lies in an advised mapping" when off: in CI's long-lived test workers a
    fresh tensor was once found in one, for a reason not found.)"""
    folder = tiny_checkpoints[TINY_PRESETS[0]]
    runs = {}
    for huge in (True, False):
        config = EngineConfig(model=str(folder), device="cpu", max_seq_len=64, use_huge_pages=huge)
        loaded = load_model(folder, dtype=torch.float32)
        engine = Engine(config, loaded_model=loaded)
        stack = engine.core.runner.cpu_decode.stack
        weights = [linear.weight for block in stack.blocks for linear in (block.qkv, block.o, block.gate_up)]
        moved = [getattr(parameter, MOVED, False) for parameter in loaded.model.parameters()]
        assert moved == [huge] * len(moved)
        if huge:
            assert all(advised_huge(weight.data_ptr()) for weight in weights)
        params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=0)
        runs[huge] = requests_at_once(engine, params)
        assert stack_steps(engine) > 0
    assert runs[True] == runs[False]
