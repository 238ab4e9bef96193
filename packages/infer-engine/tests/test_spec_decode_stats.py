"""EngineStats' speculative-decoding counters, through a real engine on CPU. The oracle replays
the request: from its prompt and the greedy tokens it streamed, the n-gram proposer's draft at
each step and the run of it that the tokens confirm give every step's verdict, so the counters
(drafts, acceptances, by position) and the tokens each step streamed are known without the
scheduler's bookkeeping."""

import pickle
from collections import Counter

import numpy as np

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams
from infer.engine.spec_decode import NgramProposer

from .test_spec_decode import NGRAM, looping_prompts

MAX_NEW_TOKENS = 40


def replayed_verdicts(prompt: list[int], output: list[int], max_new_tokens: int) -> list[tuple[int, int]]:
    """(drafts, accepted) of each step that verified drafts, for one greedy request decoding
    alone: its first token comes from the prefill; then each step drafts up to K tokens (fewer
    when max_new_tokens leaves less room), and the target accepts the drafts its own greedy tokens
    (the output) agree with, then adds one of its own."""
    proposer = NgramProposer(
        NGRAM["num_speculative_tokens"], NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"]
    )
    verdicts, known = [], 1
    while known < len(output):
        room = max_new_tokens - known - 1
        drafts = proposer.propose(np.asarray(prompt + output[:known], dtype=np.int64))[:room] if room else []
        accepted = 0
        while accepted < len(drafts) and known + accepted < len(output):
            if drafts[accepted] != output[known + accepted]:
                break
            accepted += 1
        if drafts:
            verdicts.append((len(drafts), accepted))
        known += accepted + 1
    return verdicts


def test_engine_stats_count_what_the_replayed_drafts_predict(tiny_models):
    tiny = tiny_models["llama-tiny"]
    config = EngineConfig(max_batch_size=1, max_seq_len=160, block_size=4, speculative_config=NGRAM)
    engine = Engine(config, loaded_model=tiny.loaded)
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    verdicts, tokens_per_step = [], []
    for prompt in looping_prompts(tiny, 3):
        engine.add_request(prompt, params)  # alone in the engine: every token is its
        output = []
        while engine.has_work():
            step_tokens = [o.token_id for o in engine.step() if o.token_id is not None]
            if step_tokens:
                tokens_per_step.append(len(step_tokens))
                output += step_tokens
        assert output == tiny.oracle.generate(prompt, params).token_ids  # greedy unchanged
        replayed = replayed_verdicts(prompt, output, MAX_NEW_TOKENS)
        verdicts += replayed
        # Each step streamed the prefill's token, or a verdict's accepted drafts and the target's one.
        expected_steps = [1] + [1] * (len(output) - 1 - sum(a + 1 for _, a in replayed))
        expected_steps += [a + 1 for _, a in replayed]
        assert sorted(tokens_per_step[-len(expected_steps) :]) == sorted(expected_steps)
    stats = engine.stats()
    K = NGRAM["num_speculative_tokens"]
    drafted = Counter(j for num_drafts, _ in verdicts for j in range(num_drafts))
    accepted = Counter(j for _, num_accepted in verdicts for j in range(num_accepted))
    assert stats.spec_decode_num_speculative_tokens == K
    assert stats.spec_decode_num_verified_rows == len(verdicts)
    assert stats.spec_decode_num_draft_tokens == sum(d for d, _ in verdicts)
    assert stats.spec_decode_num_accepted_tokens == sum(a for _, a in verdicts)
    assert stats.spec_decode_drafted_by_position == tuple(drafted[j] for j in range(len(drafted)))
    assert stats.spec_decode_accepted_by_position == tuple(accepted[j] for j in range(len(accepted)))
    # Both verdicts happened, and some row had all K drafts accepted.
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert len(stats.spec_decode_accepted_by_position) == K
    # Plain data: the counters cross the child process's pipe as they are.
    assert pickle.loads(pickle.dumps(stats)) == stats


def test_engine_stats_say_speculation_is_off_without_a_speculative_config(tiny_models):
    tiny = tiny_models["llama-tiny"]
    engine = Engine(EngineConfig(max_batch_size=1, max_seq_len=160), loaded_model=tiny.loaded)
    (prompt,) = looping_prompts(tiny, 1)
    engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    while engine.has_work():
        engine.step()
    stats = engine.stats()
    assert stats.num_generation_tokens_total == 8
    assert stats.spec_decode_num_speculative_tokens == 0
    assert (stats.spec_decode_num_verified_rows, stats.spec_decode_num_draft_tokens) == (0, 0)
    assert stats.spec_decode_accepted_by_position == stats.spec_decode_drafted_by_position == ()
