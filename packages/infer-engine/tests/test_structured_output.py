"""Structured output through the engine core on the real SmolLM2: a constrained request's answer
parses and validates (`jsonschema`, `re.fullmatch`: never the grammar itself), with and without
async scheduling, and the unconstrained request beside it gets exactly its tokens alone."""

import json
import re

import jsonschema
import pytest

from conformance.engine_runs import run_to_completion, token_ids
from infer.engine import Engine, EngineConfig, SamplingParams
from infer.engine.grammar_spec import GrammarSpec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "pets"],
    "additionalProperties": False,
}
MODES = {
    "sync": {},
    "async": {"async_scheduling": True},
    "chunked": {"use_chunked_prefill": True, "prefill_chunk_size": 8},
}


def answer(smollm2, outputs) -> tuple[str, str | None]:
    text = smollm2.loaded.tokenizer.decode(token_ids(outputs), skip_special_tokens=True)
    return text, outputs[-1].finish_reason


@pytest.fixture(scope="module")
def neighbour(smollm2):
    prompt = smollm2.chat_ids("Name three colours.")
    params = SamplingParams(temperature=0, max_new_tokens=24)
    # The engine's answer alone is the oracle's proposal: checked in one forward, not 24.
    proposal = smollm2.generate(prompt, params).token_ids
    return prompt, params, smollm2.oracle.generate(prompt, params, proposal=proposal).token_ids


@pytest.mark.parametrize("mode", MODES)
def test_a_schema_constrained_answer_validates_and_its_neighbour_is_untouched(smollm2, neighbour, mode):
    engine = Engine(
        EngineConfig(max_batch_size=3, max_seq_len=512, **MODES[mode]), loaded_model=smollm2.loaded
    )
    constrained = engine.add_request(
        smollm2.chat_ids("Describe a person as JSON with name, age, city and pets."),
        SamplingParams(temperature=0, max_new_tokens=160, grammar=GrammarSpec.json_schema(PERSON)),
    )
    sampled = engine.add_request(
        smollm2.chat_ids("Invent a pet owner as JSON."),
        SamplingParams(temperature=0.9, seed=5, max_new_tokens=160, grammar=GrammarSpec.json_schema(PERSON)),
    )
    prompt, params, alone = neighbour
    plain = engine.add_request(prompt, params)
    outputs = run_to_completion(engine, max_steps=2000)
    for request_id in (constrained, sampled):
        text, finish = answer(smollm2, outputs[request_id])
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert token_ids(outputs[plain]) == alone


@pytest.mark.parametrize("pattern", [r"(yes|no)", r"\d{3}-\d{4}", r"[A-Z][a-z]+ [A-Z][a-z]+"])
def test_a_regex_constrained_answer_matches_in_full(smollm2, pattern):
    engine = Engine(
        EngineConfig(max_batch_size=2, max_seq_len=512, async_scheduling=True), loaded_model=smollm2.loaded
    )
    request_id = engine.add_request(
        smollm2.chat_ids("Answer in the requested format."),
        SamplingParams(temperature=0.7, seed=3, max_new_tokens=40, grammar=GrammarSpec.regex(pattern)),
    )
    text, finish = answer(smollm2, run_to_completion(engine, max_steps=2000)[request_id])
    assert finish == "stop" and re.fullmatch(pattern, text, re.ASCII), text


def test_a_grammar_the_engine_cannot_enforce_fails_its_request_alone(smollm2, neighbour):
    engine = Engine(EngineConfig(max_batch_size=2, max_seq_len=512), loaded_model=smollm2.loaded)
    bad = engine.add_request(
        # A spec built without its checks (GrammarSpec.regex refuses this one): the core's own
        # compile is the last line.
        smollm2.chat_ids("Hi"),
        SamplingParams(max_new_tokens=5, grammar=GrammarSpec("regex", r"a(?=b)")),
    )
    prompt, params, alone = neighbour
    plain = engine.add_request(prompt, params)
    outputs = run_to_completion(engine, max_steps=2000)
    (final,) = outputs[bad]
    assert final.finished and final.token_id is None and "cannot be enforced" in final.error
    assert token_ids(outputs[plain]) == alone


def test_ignore_eos_and_a_grammar_are_refused_together():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with a grammar"):
        SamplingParams(ignore_eos=True, grammar=GrammarSpec.json_object())


def test_a_request_with_a_grammar_crosses_to_the_engine_process_whole():
    # The child process gets EngineRequests pickled, as ProcClient sends them.
    from multiprocessing.reduction import ForkingPickler

    from infer.engine.protocol import EngineRequest

    request = EngineRequest(
        "r", [1, 2], SamplingParams(max_new_tokens=4, grammar=GrammarSpec.json_schema(PERSON)), arrival_s=0.0
    )
    assert ForkingPickler.loads(ForkingPickler.dumps(request)) == request


@pytest.mark.parametrize(
    "grammar", [GrammarSpec.json_schema(PERSON), GrammarSpec.regex(r"\d{3}-\d{4}")], ids=["schema", "regex"]
)
def test_shadow_reruns_of_a_grammar_request_served_from_the_cache_count_no_divergence(smollm2, grammar):
    """The shadow check re-runs a cache hit without the cache, grammar and all: a structured
    answer recomputed is the same answer."""
    config = EngineConfig(
        max_batch_size=2,
        max_seq_len=512,
        use_chunked_prefill=True,
        block_size=16,
        use_prefix_caching=True,
        prefix_cache_shadow_rate=1.0,
    )
    engine = Engine(config, loaded_model=smollm2.loaded)
    prompt = smollm2.chat_ids("Describe a person as JSON with name, age, city and pets.")
    params = SamplingParams(temperature=0, max_new_tokens=60, grammar=grammar)
    first_id = engine.add_request(prompt, params)
    first = run_to_completion(engine, max_steps=2000)[first_id]
    again_id = engine.add_request(prompt, params)
    again = run_to_completion(engine, max_steps=2000)  # the re-run too, once idle
    assert list(again) == [again_id]  # the re-run answers nobody
    assert token_ids(again[again_id]) == token_ids(first)
    assert again[again_id][0].cached_tokens > 0  # served from the cache
    stats = engine.stats()
    assert (stats.prefix_cache_shadow_runs, stats.prefix_cache_shadow_divergences) == (1, 0)
    assert (stats.num_added, stats.num_finished, stats.num_waiting) == (2, 2, 0)  # the re-run is no request
    engine.shutdown()


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_with_speculation_a_constrained_answer_is_the_one_without_and_matches(smollm2):
    """Drafts pass the matcher before they run, and every verified position samples under its
    grammar's mask there: the greedy answer is the one without speculation, token for token, and
    the sampled one still matches. The pattern makes the model repeat itself, so drafts are
    proposed, kept and rejected."""
    pattern = r'\["(red|green|blue)"(, "(red|green|blue)"){7,11}\]'
    prompt = smollm2.chat_ids("List colours as a JSON array of strings.")
    greedy = SamplingParams(temperature=0, max_new_tokens=120, grammar=GrammarSpec.regex(pattern))
    sampled = SamplingParams(temperature=0.8, seed=7, max_new_tokens=120, grammar=GrammarSpec.regex(pattern))

    def run(speculative_config):
        engine = Engine(
            EngineConfig(max_batch_size=2, max_seq_len=512, speculative_config=speculative_config),
            loaded_model=smollm2.loaded,
        )
        ids = [engine.add_request(prompt, greedy), engine.add_request(prompt, sampled)]
        outputs = run_to_completion(engine, max_steps=2000)
        return [outputs[request_id] for request_id in ids], engine

    (plain_greedy, _), _ = run(None)
    (spec_greedy, spec_sampled), engine = run(NGRAM)
    counts = engine.core.scheduler.spec_decode_counts
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, counts
    assert token_ids(spec_greedy) == token_ids(plain_greedy)
    for outputs in (spec_greedy, spec_sampled):
        text, finish = answer(smollm2, outputs)
        assert finish == "stop" and re.fullmatch(pattern, text), text
