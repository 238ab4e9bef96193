"""Cache-free batched forwards: each row of a flat ForwardBatch gets the logits transformers gives
that prompt alone (fp32, tiny random checkpoints; on the CPU, and on a GPU where there is one).

Single-prompt full-model parity, real checkpoints included, is the parity conformance suite
(specs/parity/cases.yaml, PAR-010); this file covers what a single prompt cannot: rows of
different lengths and start positions sharing one forward.
"""

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm
from infer.models.random_checkpoint import make_random_checkpoint

ATOL = RTOL = 2e-5
# Lengths around the tiny Gemma's window of 4: shorter, equal, and longer.
PROMPT_LENGTHS = (3, 4, 11)


@pytest.fixture(scope="module", params=["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def pair(request, tmp_path_factory):
    folder = make_random_checkpoint(
        request.param, tmp_path_factory.mktemp(request.param), dtype=torch.float32
    )
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return load_causal_lm(folder, dtype=torch.float32), reference.eval()


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def test_rows_of_a_flat_batch_match_each_prompt_alone(pair):
    ours, reference = pair
    prompts = _prompts(ours.config.vocab_size)
    batch = ForwardBatch.from_tokens(prompts)
    logits = batch.rows(ours.compute_logits(ours(batch)))
    for row, prompt in enumerate(prompts):
        expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_rows_starting_mid_sequence_see_only_their_own_tokens(pair):
    """Without a cache, a row that starts at position p attends to its own tokens only, rotated
    as positions p, p+1, ...: transformers given the same position_ids agrees."""
    ours, reference = pair
    prompts = _prompts(ours.config.vocab_size)
    starts = [0, 7, 2]
    batch = ForwardBatch.from_tokens(prompts, start_positions=starts)
    logits = batch.rows(ours.compute_logits(ours(batch)))
    for row, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
        position_ids = torch.arange(start, start + len(prompt))[None]
        expected = reference(torch.tensor([prompt]), position_ids=position_ids).logits[0]
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_logits_indices_return_only_those_tokens(pair):
    """With logits_indices (the engine asks for each row's last token) the model returns those
    rows alone, and they are transformers' logits of each prompt's last position."""
    ours, reference = pair
    prompts = _prompts(ours.config.vocab_size)
    last_tokens = torch.tensor(PROMPT_LENGTHS).cumsum(0) - 1
    batch = dataclasses.replace(ForwardBatch.from_tokens(prompts), logits_indices=last_tokens)
    logits = ours.compute_logits(ours(batch))
    assert logits.shape == (len(prompts), ours.config.vocab_size)
    for row, prompt in enumerate(prompts):
        expected = reference(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@torch.no_grad()
def test_each_architecture_on_a_gpu_gives_transformers_logits(pair):
    """The model's GPU path (Triton norms, the fused QK norm and rotation of Qwen 3 and Gemma 3,
    rows of different lengths in one batch), fp32, against transformers on the same GPU."""
    ours, reference = (copy.deepcopy(model).to("cuda") for model in pair)
    prompts = _prompts(ours.config.vocab_size)
    batch = ForwardBatch.from_tokens(prompts, device="cuda")
    logits = batch.rows(ours.compute_logits(ours(batch)))
    for row, prompt in enumerate(prompts):
        expected = reference(torch.tensor([prompt], device="cuda")).logits[0]
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=RTOL)
