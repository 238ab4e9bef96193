"""`--device cpu --dtype bfloat16`: bf16 weights under float32 activations (infer.models.bf16_cpu),
decode steps through the C stack's bf16 Linears, against transformers' model on the same
bf16-rounded weights computed in float32, the independent oracle.

SmolLM2 (the default model): the greedy tokens of a chat answer, 64 of them, equal transformers'
greedy tokens; each step's logprob of its token equals transformers' over the same sequence within
LOGPROB_ATOL, through the stack and through the PyTorch path (the stack taken off the runner).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from infer.engine import Engine, EngineConfig, SamplingParams
from infer.kernels import DecoderStackCpu

pytestmark = pytest.mark.skipif(not DecoderStackCpu.runs_here(), reason="the C kernels do not build here")

NEW_TOKENS = 64
# Both sides compute in float32 on the same weights: they differ by summation order (and the
# stack's own attention and activation kernels). Measured up to ~2e-5 here; 1e-3 leaves room for
# another summation order, and is far below a wrong weight's effect (a whole unit and more).
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' eager model on the bf16-rounded weights, in float32."""
    model = AutoModelForCausalLM.from_pretrained(
        smollm2.loaded.path, dtype=torch.bfloat16, attn_implementation="eager"
    )
    return model.float().eval()


@pytest.fixture(scope="module")
def expected(smollm2, reference) -> tuple[list[int], list[int], torch.Tensor]:
    """(the prompt, transformers' greedy tokens after it, each one's logprob): computed once, as
    both paths below must give the same tokens."""
    prompt = smollm2.chat_ids("Write a short story about a lighthouse keeper.")
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        greedy = reference.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
        )[0, len(prompt) :].tolist()
        logits = reference(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(greedy)[:, None])[:, 0]
    return prompt, greedy, logprobs


@pytest.fixture(scope="module")
def bf16_engine(smollm2) -> Engine:
    config = EngineConfig(
        model=str(smollm2.loaded.path), device="cpu", dtype="bfloat16", max_seq_len=256, max_batch_size=1
    )
    return Engine(config)


def decode(engine: Engine, prompt: list[int]) -> list[tuple[int, float]]:
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    engine.add_request(prompt, params)
    out = []
    while engine.has_work():
        for output in engine.step():
            if output.token_id is not None:
                out.append((output.token_id, output.logprobs.logprob))
    return out


def test_bf16_weights_run_under_float32_activations_on_the_stack(bf16_engine):
    runner = bf16_engine.core.runner
    assert runner.cpu_decode is not None, "the bf16 model does not take the C stack"
    assert runner.model.dtype == torch.float32
    layer = runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert runner.model.lm_head.weight.dtype == torch.bfloat16
    assert layer.input_layernorm.weight.dtype == torch.float32


@pytest.mark.parametrize("stack", [True, False], ids=["stack", "pytorch-path"])
def test_greedy_tokens_and_logprobs_match_transformers_on_the_bf16_weights(stack, bf16_engine, expected):
    prompt, greedy, theirs = expected
    runner = bf16_engine.core.runner
    backend, runner.cpu_decode = runner.cpu_decode, runner.cpu_decode if stack else None
    try:
        steps_before = 0 if backend is None else backend.num_steps
        ours = decode(bf16_engine, prompt)
        assert (backend.num_steps > steps_before) == stack
    finally:
        runner.cpu_decode = backend
    assert [token for token, _ in ours] == greedy
    torch.testing.assert_close(
        torch.tensor([logprob for _, logprob in ours]), theirs, rtol=0, atol=LOGPROB_ATOL
    )
