"""The Engine end to end on CPU. The oracle for batched generation is the same request generated
alone by the recompute oracle (no cache, no batching, no scheduler): whatever the pool layout,
chunking or preemption, greedy tokens must be identical."""

import random
import time
from collections import defaultdict

import pytest
import torch

from conformance.engine_runs import run_to_completion, token_ids
from infer.engine.config import EngineConfig, EngineConfigError
from infer.engine.engine import Engine
from infer.engine.request import QueueFullError, RequestState, RequestTooLongError
from infer.engine.sampling_params import SamplingParams

MODES = {
    "paged": dict(kv_cache_backend="paged", block_size=4),
    "contiguous": dict(kv_cache_backend="contiguous"),
    "chunked-16": dict(block_size=4, use_chunked_prefill=True, prefill_chunk_size=16),
    "chunked-64": dict(block_size=4, use_chunked_prefill=True, prefill_chunk_size=64),
    "chunked-512": dict(block_size=4, use_chunked_prefill=True, prefill_chunk_size=512),
    # 24 blocks of 4 tokens for requests of up to 100 + 6 tokens: running requests outgrow the
    # pool, so the youngest is preempted and recomputed later.
    "preempted": dict(block_size=4, num_gpu_blocks=30, use_chunked_prefill=True, prefill_chunk_size=16),
    "static-contiguous": dict(batching_mode="static", kv_cache_backend="contiguous"),
    "static-paged": dict(batching_mode="static", kv_cache_backend="paged", block_size=4),
    # Each step launched before the previous step's tokens are read: decodes feed back tokens
    # whose ids are still placeholders on the host.
    "async": dict(block_size=4, async_scheduling=True),
    "async-preempted": dict(
        block_size=4,
        num_gpu_blocks=30,
        use_chunked_prefill=True,
        prefill_chunk_size=16,
        async_scheduling=True,
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def random_prompts(lengths, vocab_size, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


def make_engine(model, **settings) -> Engine:
    base = dict(max_batch_size=3, max_num_batched_tokens=16, max_seq_len=128)
    return Engine(EngineConfig(**{**base, **settings}), loaded_model=model.loaded)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_mixed_prompt_lengths_batched_give_each_request_its_tokens_alone(tiny_models, preset, mode):
    tiny = tiny_models[preset]
    # Five requests for three rows: later ones join (continuous) or wait for a second batch
    # (static); prompts longer than a chunk are prefilled over several steps.
    prompts = random_prompts([3, 30, 9, 100, 17], tiny.loaded.config.vocab_size)
    engine = make_engine(tiny, **MODES[mode])
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    outputs = run_to_completion(engine)
    if mode.endswith("preempted"):
        assert engine.stats().num_preempted > 0, "the tiny pool should have forced a preemption"
    for request_id, prompt in zip(ids, prompts, strict=True):
        alone = tiny.oracle.generate(prompt, GREEDY)
        assert token_ids(outputs[request_id]) == alone.token_ids, (
            f"{request_id} ({len(prompt)} prompt tokens)"
        )
        assert "".join(o.text_delta for o in outputs[request_id]) == alone.text
        assert outputs[request_id][-1].finish_reason == alone.finish_reason
    assert engine.core.kv_pool.allocator.num_used == 0
    assert engine.core.kv_pool.allocator.audit([]) == []


SMOLLM2_PARAMS = SamplingParams(temperature=0.0, max_new_tokens=5)


@pytest.fixture(scope="module")
def smollm2_alone(smollm2) -> dict[tuple[int, ...], list[int]]:
    """Each chat prompt's greedy tokens generated alone, computed once for both batching modes."""
    prompts = [smollm2.chat_ids(question) for question in ["What is the capital of France?", "Say hi."]]
    return {tuple(prompt): smollm2.oracle.generate(prompt, SMOLLM2_PARAMS).token_ids for prompt in prompts}


@pytest.mark.parametrize("mode", ["paged", "chunked-16", "static-contiguous"])
def test_smollm2_batched_chat_equals_each_request_alone(smollm2, smollm2_alone, mode):
    # A 16-token budget prefills the two prompts (of different lengths) over several steps.
    engine = Engine(
        EngineConfig(max_batch_size=2, max_num_batched_tokens=16, max_seq_len=128, **MODES[mode]),
        loaded_model=smollm2.loaded,
    )
    ids = {engine.add_request(list(prompt), SMOLLM2_PARAMS): prompt for prompt in smollm2_alone}
    outputs = run_to_completion(engine)
    for request_id, prompt in ids.items():
        assert token_ids(outputs[request_id]) == smollm2_alone[prompt]


@pytest.mark.parametrize("mode", ["paged", "static-contiguous", "async"])
def test_a_request_stopping_mid_batch_does_not_disturb_the_others(tiny_models, mode):
    # llama-tiny: its untied head gives varied greedy tokens (the tied tiny models repeat one).
    tiny = tiny_models["llama-tiny"]
    prompts = random_prompts([5, 12, 8], tiny.loaded.config.vocab_size, seed=2)
    long_params = SamplingParams(temperature=0.0, max_new_tokens=10)
    alone = [tiny.oracle.generate(prompt, long_params).token_ids for prompt in prompts]
    # Request 0 stops at the first token its greedy run repeats no earlier (a stop id acts as EOS).
    stop_index = next(i for i in range(2, 10) if alone[0][i] not in alone[0][:i])
    stopping = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[alone[0][stop_index]])
    engine = make_engine(tiny, **MODES[mode])
    ids = [engine.add_request(prompts[0], stopping)] + [
        engine.add_request(p, long_params) for p in prompts[1:]
    ]
    outputs = run_to_completion(engine)
    assert token_ids(outputs[ids[0]]) == alone[0][: stop_index + 1]
    assert outputs[ids[0]][-1].finish_reason == "stop"
    for request_id, expected in zip(ids[1:], alone[1:], strict=True):
        assert token_ids(outputs[request_id]) == expected


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_mid_decode_frees_the_blocks_by_the_end_of_the_next_step(tiny_models, async_scheduling):
    tiny = tiny_models["llama-tiny"]
    prompts = random_prompts([6, 10], tiny.loaded.config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    engine = make_engine(tiny, async_scheduling=async_scheduling)
    victim, survivor = (engine.add_request(prompt, params) for prompt in prompts)
    early = [output for _ in range(3) for output in engine.step()]
    assert engine.core.scheduler.get(victim).state is RequestState.RUNNING
    assert not engine.core.scheduler.get(victim).is_prefilling
    allocator = engine.core.kv_pool.allocator
    survivor_blocks = allocator.owned_by(survivor)
    assert allocator.owned_by(victim) and survivor_blocks
    assert engine.abort(victim)
    outputs = engine.step()
    final = [o for o in outputs if o.request_id == victim]
    assert (
        len(final) == 1
        and final[0].finished
        and final[0].finish_reason == "abort"
        and final[0].token_id is None
    )
    assert allocator.owned_by(victim) == []
    assert allocator.num_used == len(allocator.owned_by(survivor))
    assert allocator.audit([survivor]) == []
    assert not engine.abort(victim)  # already gone
    rest = run_to_completion(engine)
    assert victim not in rest
    survivor_tokens = [o.token_id for o in early + outputs if o.request_id == survivor] + token_ids(
        rest[survivor]
    )
    assert survivor_tokens == tiny.oracle.generate(prompts[1], params).token_ids
    assert allocator.num_used == 0
    assert engine.stats().num_aborted == 1


def test_abort_of_a_queued_request_answers_abort_and_never_runs_it(tiny_models):
    tiny = tiny_models["llama-tiny"]
    engine = make_engine(tiny, max_batch_size=1, max_num_batched_tokens=16)
    engine.add_request([1, 2, 3], GREEDY, request_id="running")
    engine.add_request([4, 5, 6], GREEDY, request_id="queued")
    first = engine.step()
    assert engine.abort("queued")
    outputs = run_to_completion(engine)
    assert [(o.token_id, o.finish_reason) for o in outputs["queued"]] == [(None, "abort")]
    assert token_ids(first + outputs["running"]) == tiny.oracle.generate([1, 2, 3], GREEDY).token_ids


def _sampled_run(tiny, seed: int, **settings) -> list:
    engine = make_engine(tiny, seed=seed, **settings)
    params = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=8)
    for prompt in random_prompts([4, 11, 7], tiny.loaded.config.vocab_size, seed=3):
        engine.add_request(prompt, params)
    outputs = []
    while engine.has_work():
        outputs.append(engine.step())
    return outputs


def test_async_scheduling_samples_the_same_tokens_one_step_later(tiny_models):
    tiny = tiny_models["llama-tiny"]
    steps = _sampled_run(tiny, 0)
    async_steps = _sampled_run(tiny, 0, async_scheduling=True)
    assert async_steps[0] == []  # the first step's tokens come with the second
    by_request = defaultdict(list)
    for step in steps:
        for output in step:
            by_request[output.request_id].append(output)
    async_by_request = defaultdict(list)
    for step in async_steps:
        for output in step:
            async_by_request[output.request_id].append(output)
    assert async_by_request == by_request


def test_same_seed_and_queue_give_identical_steps_and_another_seed_differs(tiny_models):
    tiny = tiny_models["llama-tiny"]
    first, again, other = _sampled_run(tiny, 0), _sampled_run(tiny, 0), _sampled_run(tiny, 1)
    assert first == again
    assert [o.token_id for step in first for o in step] != [o.token_id for step in other for o in step]


def test_sampling_tensors_are_built_when_the_batch_changes_not_every_step(tiny_models):
    tiny = tiny_models["llama-tiny"]
    engine = make_engine(tiny, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_new_tokens=6)
    first = engine.add_request([1, 2, 3], params)
    engine.step()  # prefill
    built = engine.core.runner._sampling[1]
    engine.step()  # decode, same batch
    assert engine.core.runner._sampling[1] is built
    engine.add_request([4, 5], params)
    engine.step()  # a second request joins
    rebuilt = engine.core.runner._sampling[1]
    assert rebuilt is not built and rebuilt.num_rows == 2
    engine.abort(first)
    engine.step()
    assert engine.core.runner._sampling[1].num_rows == 1


def test_a_request_id_used_again_after_its_request_ended_samples_with_its_own_settings(tiny_models):
    """The runner's cached sampling settings belong to the request, not to its id."""
    tiny = tiny_models["llama-tiny"]
    prompt = random_prompts([5], tiny.loaded.config.vocab_size, seed=7)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3)
    sampled = SamplingParams(temperature=1.5, seed=11, max_new_tokens=3)
    alone = token_ids(run_to_completion(_engine_with(tiny, prompt, sampled, "r"))["r"])
    engine = _engine_with(tiny, prompt, greedy, "r")
    run_to_completion(engine)
    engine.add_request(prompt, sampled, request_id="r")
    assert token_ids(run_to_completion(engine)["r"]) == alone


def _engine_with(tiny, prompt, params, request_id) -> Engine:
    engine = make_engine(tiny, max_num_batched_tokens=64)
    engine.add_request(prompt, params, request_id=request_id)
    return engine


def test_queue_time_runs_from_add_request_to_the_first_step_that_schedules_the_request(tiny_models):
    tiny = tiny_models["llama-tiny"]
    engine = make_engine(tiny, max_batch_size=1)
    first = engine.add_request([1, 2, 3], GREEDY)
    engine.add_request([4, 5, 6], GREEDY)
    added = time.monotonic()
    first_tokens, second_tokens = [], []
    first_done = None
    while engine.has_work():
        for output in engine.step():
            if output.token_id is not None:
                (first_tokens if output.request_id == first else second_tokens).append(output)
            if output.request_id == first and output.finished:
                first_done = time.monotonic()
    # Reported once, on the first token.
    assert [o.queue_time_s is not None for o in first_tokens] == [True] + [False] * (len(first_tokens) - 1)
    assert [o.queue_time_s is not None for o in second_tokens] == [True] + [False] * (len(second_tokens) - 1)
    # The second waited for the first to finish (one request at a time).
    assert second_tokens[0].queue_time_s >= first_done - added > first_tokens[0].queue_time_s >= 0


def test_the_prompt_rate_is_over_prefill_steps_so_decoding_does_not_dilute_it(tiny_models):
    tiny = tiny_models["llama-tiny"]
    engine = make_engine(tiny)
    engine.add_request(list(range(1, 12)), SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))
    engine.step()  # the whole prompt
    after_prefill = engine.stats()
    run_to_completion(engine)
    after_decode = engine.stats()
    assert after_decode.busy_time_s > after_prefill.busy_time_s
    assert after_decode.prompt_tokens_per_s == after_prefill.prompt_tokens_per_s > 0
    assert after_prefill.prompt_tokens_per_s == 11 / after_prefill.busy_time_s


@pytest.mark.parametrize(
    "settings",
    [
        dict(presence_penalty=1.5, frequency_penalty=0.5),
        dict(frequency_penalty=2.0),
        dict(logit_bias={7: 3.0, 11: -100.0}, presence_penalty=-1.0),
    ],
    ids=["presence+frequency", "frequency", "bias+negative-presence"],
)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_penalties_and_logit_bias_give_transformers_greedy_with_openais_formula(
    tiny_models, settings, async_scheduling
):
    """The oracle: transformers' logits of the whole sequence each step, adjusted in Python by
    OpenAI's definitions (penalties over the generated ids only, never the prompt), then argmax."""
    tiny = tiny_models["llama-tiny"]
    start = random_prompts([9], tiny.loaded.config.vocab_size, seed=5)[0]
    # The prompt ends with the tokens the model goes on to prefer: penalizing prompt tokens (which
    # OpenAI's penalties do not) would change the answer.
    prompt = start + tiny.transformers_greedy(start, 12)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, **settings)
    # Async: the penalties read the previous step's ids on the host before they are otherwise read.
    engine = make_engine(tiny, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    # A second request in the batch with none of the settings must keep its own tokens.
    plain = engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    steered = engine.add_request(prompt, params)
    outputs = run_to_completion(engine)
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(12):
            logits = tiny.reference(torch.tensor([prompt + generated])).logits[0, -1].double()
            for token_id, bias in params.logit_bias.items():
                logits[token_id] += bias
            for token_id in set(generated):
                count = generated.count(token_id)
                logits[token_id] -= params.frequency_penalty * count + params.presence_penalty
            generated.append(int(logits.argmax()))
    assert token_ids(outputs[steered]) == generated
    assert token_ids(outputs[plain]) == tiny.transformers_greedy(prompt, 12)
    assert generated != tiny.transformers_greedy(prompt, 12)  # the settings did change something


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_min_tokens_keeps_a_stop_token_out_until_then_as_transformers_greedy_with_it_masked(
    tiny_models, async_scheduling
):
    tiny = tiny_models["llama-tiny"]
    prompt = random_prompts([7], tiny.loaded.config.vocab_size, seed=8)[0]
    natural = tiny.transformers_greedy(prompt, 12)
    stop_id = natural[1]  # without min_tokens the request stops at its second token
    base = dict(temperature=0, max_new_tokens=12, stop_token_ids=[stop_id], ignore_eos=True)
    engine = make_engine(tiny, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    plain = engine.add_request(prompt, SamplingParams(**base))
    held = engine.add_request(prompt, SamplingParams(**base, min_tokens=6))
    outputs = run_to_completion(engine)
    assert token_ids(outputs[plain]) == natural[:2] and outputs[plain][-1].finish_reason == "stop"
    # The oracle: transformers' argmax with the stop token masked while fewer than 6 are out,
    # then the first stop token ends it.
    generated: list[int] = []
    with torch.inference_mode():
        while len(generated) < 12:
            logits = tiny.reference(torch.tensor([prompt + generated])).logits[0, -1]
            if len(generated) < 6:
                logits[stop_id] = -torch.inf
            generated.append(int(logits.argmax()))
            if len(generated) > 6 and generated[-1] == stop_id:
                break
    assert token_ids(outputs[held]) == generated
    assert stop_id not in generated[:6] and len(generated) > 2


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failing_forward_fails_its_step_frees_blocks_and_the_engine_goes_on(tiny_models, async_scheduling):
    tiny = tiny_models["llama-tiny"]
    engine = make_engine(tiny, async_scheduling=async_scheduling)
    ids = [engine.add_request(prompt, GREEDY) for prompt in random_prompts([4, 6], 384, seed=4)]
    engine.step()  # both prefilled; the next step decodes them together
    real_logits = engine.core.runner._logits

    def forward_that_raises(step, images=None):
        engine.core.runner._logits = real_logits
        raise RuntimeError("CUDA error: simulated")

    engine.core.runner._logits = forward_that_raises
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == sorted(ids)
    assert all(o.finished and o.finish_reason is None and "simulated" in o.error for o in outputs)
    assert all(engine.core.scheduler.get(i) is None for i in ids)
    assert engine.core.kv_pool.allocator.num_used == 0
    assert engine.stats().num_failed == 2
    later = engine.add_request([7, 8, 9], GREEDY)
    assert token_ids(run_to_completion(engine)[later]) == tiny.oracle.generate([7, 8, 9], GREEDY).token_ids


def test_too_long_requests_and_a_full_queue_are_refused_at_add_request(tiny_models):
    tiny = tiny_models["qwen3-tiny"]
    engine = make_engine(tiny, max_seq_len=32, max_queue_len=2)
    with pytest.raises(RequestTooLongError, match="max_seq_len \\(32\\)"):
        engine.add_request(list(range(1, 30)), SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([1, 10**6], GREEDY)
    engine.add_request([1, 2], GREEDY)
    engine.add_request([1, 2], GREEDY)
    with pytest.raises(QueueFullError, match="max_queue_len is 2"):
        engine.add_request([1, 2], GREEDY)
    assert engine.stats().num_waiting == 2


def test_max_seq_len_beyond_the_model_is_refused(tiny_models):
    tiny = tiny_models["qwen3-tiny"]
    with pytest.raises(EngineConfigError, match="exceeds the model's max_position_embeddings"):
        make_engine(tiny, max_seq_len=tiny.loaded.config.max_position_embeddings + 1)


def test_text_prompts_and_stats(tiny_models):
    tiny = tiny_models["llama-tiny"]
    engine = make_engine(tiny)
    request_id = engine.add_request("hello world", GREEDY)
    first = engine.step()
    running = engine.stats()
    allocator = engine.core.kv_pool.allocator
    assert running.num_running == 1 and allocator.num_used > 0
    assert running.kv_usage_ratio == allocator.num_used / engine.core.kv_pool.num_blocks
    assert running.kv_bytes_used == allocator.num_used * engine.core.kv_pool.shape.bytes_per_block()
    outputs = run_to_completion(engine)
    prompt_ids = tiny.loaded.tokenizer.encode("hello world", add_special_tokens=True)
    assert token_ids(first + outputs[request_id]) == tiny.oracle.generate(prompt_ids, GREEDY).token_ids
    done = engine.stats()
    assert (done.num_running, done.kv_usage_ratio, done.num_finished) == (0, 0.0, 1)
    assert done.num_generation_tokens_total == GREEDY.max_new_tokens
    assert done.num_prompt_tokens_total == len(prompt_ids)
    assert done.generation_tokens_per_s > 0


def test_one_requests_extreme_sampling_settings_do_not_touch_its_batch(tiny_models):
    """Issue: a tiny temperature or repetition penalty made NaN in the sampler and failed every
    request of the step. Now the extreme request finishes, and its neighbour's tokens are those
    it gets alone."""
    tiny = tiny_models["llama-tiny"]
    engine = make_engine(tiny)
    extreme = [
        SamplingParams(temperature=1e-37, max_new_tokens=6),
        SamplingParams(temperature=1.0, repetition_penalty=1e-39, max_new_tokens=6, seed=5),
    ]
    prompt = [5, 6, 7, 8]
    ids = [engine.add_request(prompt, params) for params in extreme]
    neighbour = engine.add_request([9, 10, 11], GREEDY)
    outputs = run_to_completion(engine)
    for request_id in [*ids, neighbour]:
        assert outputs[request_id][-1].error is None and outputs[request_id][-1].finished
        assert len(token_ids(outputs[request_id])) == 6
    assert token_ids(outputs[neighbour]) == tiny.oracle.generate([9, 10, 11], GREEDY).token_ids
    assert token_ids(outputs[ids[0]]) == tiny.oracle.generate(prompt, GREEDY).token_ids
