"""Speculative decoding through the Engine on CPU. The oracle is the recompute oracle (no cache, no
batching, no speculation): greedy tokens must be identical with speculation on, in every mode;
the KV blocks of rejected drafts must come back; a step never runs more than its token budget."""

import json
import shutil

import pytest
import torch

from conformance.engine_runs import run_to_completion, token_ids
from conformance.oracles import RecomputeOracle
from conformance.spec_decode.checks import noisy_copy
from infer.cache.prefix_tree import TREE_OWNER
from infer.engine.config import EngineConfig, EngineConfigError
from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams
from infer.engine.spec_decode import SpecDecodeCounts
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

from .test_engine import random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MODES = {
    "paged": dict(block_size=4),
    "chunked-prefix-cache": dict(
        block_size=4, use_chunked_prefill=True, prefill_chunk_size=16, use_prefix_caching=True
    ),
    # A pool too small for every request at once: the youngest is preempted and recomputed.
    "preempted": dict(block_size=4, num_gpu_blocks=40, use_chunked_prefill=True, prefill_chunk_size=16),
}
NUM_TOKENS = 40


def make_engine(model, **settings) -> Engine:
    base = dict(max_batch_size=3, max_num_batched_tokens=32, max_seq_len=160, speculative_config=NGRAM)
    return Engine(EngineConfig(**{**base, **settings}), loaded_model=model.loaded)


def looping_prompts(tiny, count: int) -> list[list[int]]:
    """Prompts that end with the model's own greedy continuation of a random start: a tiny random
    model soon repeats itself, so its next tokens recur in its context and n-gram drafts are
    often right (and sometimes wrong)."""
    starts = random_prompts([5 + 7 * i for i in range(count)], tiny.loaded.config.vocab_size, seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    return [start + tiny.oracle.generate(start, params).token_ids for start in starts]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_ngram_speculation_keeps_every_greedy_token_of_the_recompute_oracle(tiny_models, preset, mode):
    tiny = tiny_models[preset]
    # And prompts that end by repeating their own start: the n-gram lookup drafts what followed
    # it, which the model, with its own continuation in mind, mostly rejects.
    repeating = [
        start + start[:10] for start in random_prompts([30, 45], tiny.loaded.config.vocab_size, seed=4)
    ]
    prompts = looping_prompts(tiny, 3) + repeating
    params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    engine = make_engine(tiny, **MODES[mode])
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs = run_to_completion(engine)
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert token_ids(outputs[request_id]) == tiny.oracle.generate(prompt, params).token_ids, request_id
    counts = engine.core.scheduler.spec_decode_counts
    # Both verdicts happened: drafts were kept, and drafts were rolled back.
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, counts
    if mode == "preempted":
        assert engine.stats().num_preempted > 0
    allocator = engine.core.kv_pool.allocator
    # No finished request holds a block; only the prefix tree keeps what they computed.
    assert allocator.audit([TREE_OWNER]) == []
    if engine.core.prefix_tree is None:
        assert allocator.num_used == 0


def test_speculation_emits_several_tokens_in_one_step_within_max_tokens_and_stops(tiny_models):
    tiny = tiny_models["llama-tiny"]
    (prompt,) = looping_prompts(tiny, 1)
    plain = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    expected = tiny.oracle.generate(prompt, plain).token_ids
    # A stop token the model emits late in its answer: it ends inside an accepted run or at a
    # verified position, and nothing after it is emitted.
    stop = expected[-5]
    for params in (
        SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS - 3, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True, stop_token_ids=[stop]),
    ):
        engine = make_engine(tiny)
        request_id = engine.add_request(prompt, params)
        outputs = run_to_completion(engine)[request_id]
        assert token_ids(outputs) == tiny.oracle.generate(prompt, params).token_ids
        # Several tokens in a step: verified rows emitted more than one token on average.
        assert engine.core.scheduler.spec_decode_counts.mean_accepted_length > 1


def test_the_step_budget_holds_drafts_and_a_step_over_the_batch_limit_does_not_speculate(tiny_models):
    tiny = tiny_models["qwen3-tiny"]
    prompts = looping_prompts(tiny, 4)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    speculative = {**NGRAM, "disable_by_batch_size": 2}
    engine = make_engine(
        tiny,
        max_num_batched_tokens=8,
        max_batch_size=3,
        use_chunked_prefill=True,
        prefill_chunk_size=8,
        speculative_config=speculative,
    )
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    scheduler = engine.core.scheduler
    schedule = scheduler.schedule
    decisions = []

    def recording_schedule():
        decision = schedule()
        decisions.append((decision, scheduler.num_running))
        return decision

    scheduler.schedule = recording_schedule
    outputs = run_to_completion(engine)
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert token_ids(outputs[request_id]) == tiny.oracle.generate(prompt, params).token_ids
    assert any(decision.spec_token_ids for decision, _ in decisions)
    for decision, num_running in decisions:
        assert decision.total_num_scheduled_tokens <= 8
        if num_running > 2:
            assert not decision.spec_token_ids


def test_seeded_sampling_with_speculation_gives_the_same_tokens_again(tiny_models):
    """Run to run, the same seeded batch gives the same tokens (how many drafts a row verifies
    depends on the step's budget, so not whatever else shares its batch)."""
    tiny = tiny_models["gemma3-tiny"]
    prompts = looping_prompts(tiny, 3)
    seeded = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_new_tokens=NUM_TOKENS, ignore_eos=True)
        for i in range(3)
    ]

    def run() -> list[list[int]]:
        engine = make_engine(tiny)
        ids = [engine.add_request(prompt, params) for prompt, params in zip(prompts, seeded, strict=True)]
        outputs = run_to_completion(engine)
        assert engine.core.scheduler.spec_decode_counts.num_accepted_tokens > 0
        return [token_ids(outputs[request_id]) for request_id in ids]

    first = run()
    assert run() == first
    assert len({tuple(tokens) for tokens in first}) == 3


def test_logprobs_with_speculation_are_those_of_the_tokens_without_it(tiny_models):
    """Each emitted token's logprob and top alternatives, whether it came from an accepted draft
    or the target: the same as a run without speculation (the model's raw distribution at the
    token's position)."""
    tiny = tiny_models["qwen3-tiny"]
    prompts = looping_prompts(tiny, 2)
    params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)

    def run(**settings) -> tuple[list, Engine]:
        engine = make_engine(tiny, **settings)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        outputs = run_to_completion(engine)
        return [
            [output.logprobs for output in outputs[request_id] if output.token_id is not None]
            for request_id in ids
        ], engine

    plain, _ = run(speculative_config=None)
    speculated, engine = run()
    assert engine.core.scheduler.spec_decode_counts.num_accepted_tokens > 0
    for ours, theirs in zip(speculated, plain, strict=True):
        assert len(ours) == len(theirs) == NUM_TOKENS
        for mine, reference in zip(ours, theirs, strict=True):
            assert mine.top_token_ids == reference.top_token_ids
            assert mine.logprob == pytest.approx(reference.logprob, abs=1e-4)
            assert mine.top_logprobs == pytest.approx(reference.top_logprobs, abs=1e-4)


@pytest.fixture(scope="module")
def drafts_of_llama_tiny(tiny_checkpoints) -> dict[str, str]:
    """Draft models for llama-tiny: itself (every greedy draft right), and a copy whose weights
    carry noise (conformance.spec_decode's)."""
    target = tiny_checkpoints["llama-tiny"]
    return {"itself": str(target), "noisy": str(noisy_copy(target))}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("draft", ["itself", "noisy"])
def test_a_draft_model_keeps_every_greedy_token_of_the_recompute_oracle(
    tiny_models, drafts_of_llama_tiny, draft, mode
):
    tiny = tiny_models["llama-tiny"]
    prompts = looping_prompts(tiny, 3) + random_prompts([30, 45], tiny.loaded.config.vocab_size, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    # Every step speculates (no back-off): verdicts of every kind in every mode.
    speculative = {
        "method": "draft_model",
        "model": drafts_of_llama_tiny[draft],
        "num_speculative_tokens": 3,
        "min_acceptance_rate": 0,
    }
    engine = make_engine(tiny, speculative_config=speculative, **MODES[mode])
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs = run_to_completion(engine)
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert token_ids(outputs[request_id]) == tiny.oracle.generate(prompt, params).token_ids, request_id
    counts = engine.core.scheduler.spec_decode_counts
    if draft == "itself":
        # The target's own greedy choices: every draft is kept.
        assert counts.num_draft_tokens > 0 and counts.num_accepted_tokens == counts.num_draft_tokens, counts
    else:
        assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, counts
    allocator = engine.core.kv_pool.allocator
    assert allocator.audit([TREE_OWNER]) == []
    if engine.core.prefix_tree is None:
        assert allocator.num_used == 0


def test_a_draft_model_with_another_vocabulary_is_refused_naming_the_key(tiny_models, tiny_checkpoints):
    speculative = {
        "method": "draft_model",
        "model": str(tiny_checkpoints["qwen3-tiny"]),
        "num_speculative_tokens": 2,
    }
    with pytest.raises(
        EngineConfigError, match="speculative_config.model .* does not share the target's vocabulary"
    ):
        make_engine(tiny_models["llama-tiny"], speculative_config=speculative)


def test_each_draft_is_the_draft_models_own_greedy_continuation(tiny_models, drafts_of_llama_tiny):
    """The proposer's oracle: the draft model alone, recomputing from scratch, continues the
    request's known tokens greedily with exactly the drafts proposed. So the draft's K/V stays
    right as the target keeps some drafts and rejects others (and after preemptions)."""
    tiny = tiny_models["llama-tiny"]
    draft_oracle = RecomputeOracle(load_model(drafts_of_llama_tiny["noisy"], dtype=torch.float32))
    prompts = looping_prompts(tiny, 3) + random_prompts([30, 45], tiny.loaded.config.vocab_size, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    speculative = {
        "method": "draft_model",
        "model": drafts_of_llama_tiny["noisy"],
        "num_speculative_tokens": 3,
    }
    engine = make_engine(tiny, speculative_config=speculative, **MODES["preempted"])
    proposer = engine.core.runner.draft
    propose = proposer.propose
    proposals = []

    def recording_propose(batch, request_ids):
        drafts = propose(batch, request_ids)
        for request_id, tokens in drafts.items():
            proposals.append((batch.history(request_id).tolist(), tokens))
        return drafts

    proposer.propose = recording_propose
    for prompt in prompts:
        engine.add_request(prompt, params)
    run_to_completion(engine)
    assert engine.stats().num_preempted > 0
    counts = engine.core.scheduler.spec_decode_counts
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, counts
    greedy = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    for known, drafts in proposals:
        assert list(drafts) == draft_oracle.generate(known, greedy).token_ids


def test_a_draft_model_that_is_never_right_backs_off_and_keeps_the_oracles_tokens(tiny_models, tmp_path):
    """The automatic back-off: a draft model unlike its target (another random checkpoint, whose
    greedy drafts the target almost never keeps) runs and is verified on a few steps, then on
    ever fewer; with min_acceptance_rate 0, before every step. Its K/V stays right across the
    steps it sits out (each probe catches up): the tokens are the oracle's either way."""
    tiny = tiny_models["llama-tiny"]
    stranger = make_random_checkpoint("llama-tiny", tmp_path / "stranger", seed=1, dtype=torch.float32)
    prompts = random_prompts([20, 30], tiny.loaded.config.vocab_size, seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=120, ignore_eos=True)

    def run(**settings) -> tuple[int, SpecDecodeCounts]:
        speculative = {"method": "draft_model", "model": str(stranger), "num_speculative_tokens": 3}
        engine = make_engine(tiny, speculative_config={**speculative, **settings})
        proposer = engine.core.runner.draft
        propose = proposer.propose
        num_proposals = 0

        def counting_propose(batch, request_ids):
            nonlocal num_proposals
            num_proposals += len(request_ids)
            return propose(batch, request_ids)

        proposer.propose = counting_propose
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        outputs = run_to_completion(engine)
        for request_id, prompt in zip(ids, prompts, strict=True):
            assert token_ids(outputs[request_id]) == tiny.oracle.generate(prompt, params).token_ids
        return num_proposals, engine.core.scheduler.spec_decode_counts

    every_step_proposals, every_step = run(min_acceptance_rate=0)
    backed_off_proposals, backed_off = run()
    # The premise: the stranger's drafts are almost all rejected, and without the back-off
    # nearly every one of the ~120 steps verifies both rows.
    assert every_step.acceptance_rate < 0.1 and every_step.num_verified_rows > 200, every_step
    # With it, the draft runs for a few rows only, and some of them after the back-off began (its
    # probes): after the first failing step, on every 8th, then every 64th step.
    assert backed_off_proposals < every_step_proposals / 8
    assert 4 < backed_off.num_verified_rows < every_step.num_verified_rows / 8, backed_off


@pytest.mark.parametrize("draft", ["itself", "noisy", "stranger"])
def test_with_async_scheduling_steps_overlap_except_before_a_step_that_verifies_drafts(
    tiny_models, drafts_of_llama_tiny, draft, tmp_path
):
    """Async scheduling with a draft model: a step launches while the one before it runs, but
    never while a step whose drafts it would verify (or draft from) is unread; the tokens are the
    oracle's. A stranger (another random checkpoint) backs off, and then most steps overlap."""
    tiny = tiny_models["llama-tiny"]
    drafts = {**drafts_of_llama_tiny}
    drafts["stranger"] = str(
        make_random_checkpoint("llama-tiny", tmp_path / "s", seed=1, dtype=torch.float32)
    )
    prompts = looping_prompts(tiny, 3) + random_prompts([30, 45], tiny.loaded.config.vocab_size, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    speculative = {"method": "draft_model", "model": drafts[draft], "num_speculative_tokens": 3}
    engine = make_engine(tiny, speculative_config=speculative, async_scheduling=True, max_seq_len=256)
    runner = engine.core.runner
    launch = runner.launch
    overlapped = []

    def recording_launch(decision):
        overlapped.append(bool(runner._launched))
        return launch(decision)

    runner.launch = recording_launch
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs = run_to_completion(engine)
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert token_ids(outputs[request_id]) == tiny.oracle.generate(prompt, params).token_ids, request_id
    counts = engine.core.scheduler.spec_decode_counts
    assert counts.num_verified_rows > 0
    if draft == "stranger":
        assert sum(overlapped) > len(overlapped) / 2, (sum(overlapped), len(overlapped))
    else:  # drafts good enough to keep speculating: every step verifies or drafts
        assert counts.num_accepted_tokens > 0


def test_a_draft_model_drafts_no_position_past_max_seq_len(tiny_models, drafts_of_llama_tiny):
    """Requests that end at max_seq_len exactly: the draft's lookahead and its decode steps stop
    at the last position a sequence may have."""
    tiny = tiny_models["llama-tiny"]
    prompts = looping_prompts(tiny, 2)
    speculative = {
        "method": "draft_model",
        "model": drafts_of_llama_tiny["itself"],
        "num_speculative_tokens": 4,
    }
    max_seq_len = max(len(prompt) for prompt in prompts) + 9
    engine = make_engine(tiny, max_seq_len=max_seq_len, block_size=1, speculative_config=speculative)
    for prompt in prompts:
        params = SamplingParams(temperature=0, max_new_tokens=max_seq_len - len(prompt), ignore_eos=True)
        request_id = engine.add_request(prompt, params)
        outputs = run_to_completion(engine)[request_id]
        assert token_ids(outputs) == tiny.oracle.generate(prompt, params).token_ids
    assert engine.core.scheduler.spec_decode_counts.num_accepted_tokens > 0


def test_a_draft_model_with_fewer_positions_than_max_seq_len_is_refused(tiny_models, tmp_path):
    """A draft that could not place the drafts of a long request (its RoPE tables end sooner)."""
    target = tiny_models["llama-tiny"]
    short = tmp_path / "short-draft"
    shutil.copytree(target.loaded.path, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(config))
    speculative = {"method": "draft_model", "model": str(short), "num_speculative_tokens": 2}
    with pytest.raises(EngineConfigError, match=r"holds 64 positions, fewer than max_seq_len \(160\)"):
        make_engine(target, speculative_config=speculative)


def test_a_bf16_draft_model_on_the_cpu_runs_as_its_bf16_target(tiny_checkpoints):
    """On a CPU a bf16 target runs its bf16 weights under float32 activations
    (infer.models.bf16_cpu); its draft model is loaded in bf16 and widened the same way, so a
    draft of the target's own checkpoint drafts the target's own greedy tokens: all are kept."""
    from infer.kernels import DecoderStackCpu

    if not DecoderStackCpu.runs_here():
        pytest.skip("the C kernels do not build here")
    path = str(tiny_checkpoints["llama-tiny"])
    speculative = {
        "method": "draft_model",
        "model": path,
        "num_speculative_tokens": 3,
        "min_acceptance_rate": 0,
    }
    config = EngineConfig(
        model=path,
        device="cpu",
        dtype="bfloat16",
        max_batch_size=2,
        max_seq_len=160,
        speculative_config=speculative,
    )
    engine = Engine(config)
    vocab_size = engine.core.runner.model.config.vocab_size
    params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    for prompt in random_prompts([20, 33], vocab_size, seed=5):
        engine.add_request(prompt, params)
    run_to_completion(engine)
    counts = engine.core.scheduler.spec_decode_counts
    assert counts.num_draft_tokens > 0 and counts.num_accepted_tokens == counts.num_draft_tokens, counts
