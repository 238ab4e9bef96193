"""On CUDA in bf16 with real shapes: n-gram speculation keeps the recompute oracle's greedy tokens
(up to a bf16 near tie, as test_gpu.py), with the device's defaults (CUDA graphs: a verified
request's K + 1 decode rows replay the decode graphs)."""

import pytest
import torch

from conformance.oracles import RecomputeOracle
from infer.engine import Engine, EngineConfig, SamplingParams
from infer.engine.spec_decode import SpeculationBackoff

from .test_gpu import (  # noqa: F401
    NUM_TOKENS,
    assert_equal_up_to_a_near_tie,
    assert_no_kernel_compiled_since,
    compiled_kernel_variants,
    real_shape,
    run_together,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.gpu
def test_ngram_speculation_equals_recompute_in_bf16_up_to_a_near_tie(real_shape):  # noqa: F811
    preset, loaded, prompts, params, expected = real_shape
    # Each prompt followed by its own greedy answer, then the prompt again: the n-gram lookup
    # drafts what followed before, so verification runs on every kind of verdict.
    looping = [prompt + answer + prompt[:8] for prompt, answer in zip(prompts, expected, strict=True)]
    oracle_params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    config = EngineConfig(
        device="cuda", dtype="bfloat16", max_batch_size=8, max_seq_len=1024, speculative_config=NGRAM
    )
    engine = Engine(config, loaded_model=loaded)
    tokens = run_together(engine, looping, oracle_params)
    assert engine.core.scheduler.spec_decode_counts.num_draft_tokens > 0
    assert engine.core.runner.graphs.num_replays["decode"] > 0
    oracle = RecomputeOracle(loaded)
    for prompt, ours in zip(looping, tokens, strict=True):
        oracle_tokens = oracle.generate(prompt, oracle_params).token_ids
        assert_equal_up_to_a_near_tie(loaded.model, prompt, ours, oracle_tokens, f"{preset}/ngram")


@pytest.mark.gpu
def test_a_draft_model_equals_recompute_in_bf16_and_itself_as_draft_is_accepted(real_shape):  # noqa: F811
    """The target as its own draft: the greedy tokens are recompute's (up to a near tie) and
    most drafts are kept (a bf16 near tie may tell the draft's decode rows from the
    verification's)."""
    preset, loaded, prompts, params, expected = real_shape
    speculative = {"method": "draft_model", "model": str(loaded.path), "num_speculative_tokens": 4}
    config = EngineConfig(
        device="cuda", dtype="bfloat16", max_batch_size=8, max_seq_len=1024, speculative_config=speculative
    )
    engine = Engine(config, loaded_model=loaded)
    tokens = run_together(engine, prompts, params)
    counts = engine.core.scheduler.spec_decode_counts
    # Random real-shape weights give flat logits, where bf16 rounding that differs between the
    # draft's decode rows and the verification flips an argmax: 0.89 kept on llama-3.2-1b shapes
    # (H200, 2026-11-29); a draft whose K/V went wrong keeps almost none.
    assert counts.num_draft_tokens > 0 and counts.acceptance_rate > 0.8, counts
    for prompt, ours, oracle_tokens in zip(prompts, tokens, expected, strict=True):
        assert_equal_up_to_a_near_tie(loaded.model, prompt, ours, oracle_tokens, f"{preset}/draft-model")


@pytest.mark.gpu
def test_a_draft_models_probes_compile_no_kernel_after_start_up(real_shape):  # noqa: F811
    """The back-off's probes run the draft over histories of any length (eager catch-up
    forwards) and verify a few rows beside many decode rows: start-up must have compiled those
    kernels too, or each probe stalls its step for a compile. The target drafts for itself, and
    its back-off is told every draft failed (a real failing draft needs a second real-shape
    checkpoint), so it runs only the probes: the draft and target forwards are real."""
    preset, loaded, _, _, _ = real_shape
    speculative = {"method": "draft_model", "model": str(loaded.path), "num_speculative_tokens": 4}
    config = EngineConfig(
        device="cuda", dtype="bfloat16", max_batch_size=8, max_seq_len=1024, speculative_config=speculative
    )
    engine = Engine(config, loaded_model=loaded)
    backoff = engine.core.scheduler.speculation_backoff
    backoff.record = lambda num_draft_tokens, _: SpeculationBackoff.record(backoff, num_draft_tokens, 0)
    compiled = compiled_kernel_variants()
    generator = torch.Generator().manual_seed(2)
    for i, length in enumerate((5, 61, 300, 17, 700, 130)):
        prompt = torch.randint(0, loaded.config.vocab_size, (length,), generator=generator).tolist()
        params = SamplingParams(temperature=0, max_new_tokens=40 + 30 * i, ignore_eos=True)
        engine.add_request(prompt, params)
        for _ in range(7):  # arrivals while others decode
            engine.step()
    while engine.has_work():
        engine.step()
    counts = engine.core.scheduler.spec_decode_counts
    assert counts.num_verified_rows > 4 and backoff.interval > 1, counts
    assert_no_kernel_compiled_since(compiled)
