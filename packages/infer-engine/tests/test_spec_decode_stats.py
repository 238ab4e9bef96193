"""EngineStats' speculative-decoding counters, through a real engine on CPU. The oracle replays
each request (conformance.spec_decode_replay): from its prompt and the greedy tokens it streamed,
the n-gram proposer's draft at each step and the run of it that the tokens confirm give every
step's verdict, so the counters (drafts, acceptances, by position) and the tokens each step
streamed are known without the scheduler's bookkeeping."""

import pickle

from conformance.spec_decode_replay import ReplayedCounts, replay_ngram
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams

from .test_spec_decode import NGRAM, looping_prompts

MAX_NEW_TOKENS = 40


def test_engine_stats_count_what_the_replayed_drafts_predict(tiny_models):
    tiny = tiny_models["llama-tiny"]
    config = EngineConfig(max_batch_size=1, max_seq_len=160, block_size=4, speculative_config=NGRAM)
    engine = Engine(config, loaded_model=tiny.loaded)
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    verdicts = []
    for prompt in looping_prompts(tiny, 3):
        engine.add_request(prompt, params)  # alone in the engine: every token a step emits is its
        output, tokens_per_step = [], []
        while engine.has_work():
            step_tokens = [o.token_id for o in engine.step() if o.token_id is not None]
            if step_tokens:
                tokens_per_step.append(len(step_tokens))
                output += step_tokens
        assert output == tiny.oracle.generate(prompt, params).token_ids  # greedy unchanged
        replayed = replay_ngram(NGRAM, prompt, output, MAX_NEW_TOKENS)
        assert sorted(tokens_per_step) == replayed.tokens_per_step(len(output))
        verdicts += replayed.verdicts
    stats = engine.stats()
    expected = ReplayedCounts(tuple(verdicts))
    K = NGRAM["num_speculative_tokens"]
    assert stats.spec_decode_num_speculative_tokens == K
    assert stats.spec_decode_num_verified_rows == expected.num_verified_rows
    assert stats.spec_decode_num_draft_tokens == expected.num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens == expected.num_accepted_tokens
    assert stats.spec_decode_drafted_by_position == expected.drafted_by_position
    assert stats.spec_decode_accepted_by_position == expected.accepted_by_position
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
