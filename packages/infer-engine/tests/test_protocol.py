"""What crosses between the frontend and the core comes out of a pickle as it went in (the child
process's pipe pickles it), finish reasons and statistics included."""

import dataclasses
import pickle

import numpy as np

from infer.engine.protocol import (
    EngineOutput,
    EngineOutputs,
    EngineStats,
    FinishReason,
    PromptLogprobs,
    TokenLogprobs,
)


def test_engine_outputs_cross_a_pickle_unchanged():
    stats = EngineStats(
        *range(16), spec_decode_num_speculative_tokens=3, spec_decode_num_verified_rows=4,
        spec_decode_num_draft_tokens=9, spec_decode_num_accepted_tokens=5,
        spec_decode_accepted_by_position=(3, 2), spec_decode_drafted_by_position=(4, 3, 2),
    )  # fmt: skip
    outputs = EngineOutputs(
        [
            EngineOutput("a", [5, 6], FinishReason.STOP, 3, num_cached_tokens=2, queue_time_s=0.25),
            EngineOutput("b", [7], None, 4, logprobs=[TokenLogprobs(-0.5, [7, 2], [-0.5, -1.25])]),
            EngineOutput("c", [], FinishReason.ERROR, 9, error="RuntimeError: boom"),
        ],
        stats,
    )
    crossed = pickle.loads(pickle.dumps(outputs))
    assert crossed == outputs
    finish_types = [type(output.finish_reason) for output in crossed.outputs]
    assert finish_types == [FinishReason, type(None), FinishReason]
    assert crossed.stats == stats
    assert type(crossed.stats.spec_decode_accepted_by_position) is tuple


def test_every_statistic_crosses_a_pickle_in_its_own_field():
    """Each field with a value no other has, of its own type: a field read into another's place,
    or left at its default, shows."""
    values = {}
    for index, f in enumerate(dataclasses.fields(EngineStats)):
        text = str(f.type)  # "<class 'int'>", "tuple[int, ...]", "str | None", ...
        if "tuple" in text:
            values[f.name] = (index, index + 1)
        elif "dict" in text:
            values[f.name] = {f"kind{index}": index}
        elif "float" in text:
            values[f.name] = index + 0.5
        elif "str" in text:
            values[f.name] = f"value{index}"
        else:
            values[f.name] = index + 1
    stats = EngineStats(**values)
    crossed = pickle.loads(pickle.dumps(EngineOutputs([], stats)))
    assert {name: getattr(crossed.stats, name) for name in values} == values


def test_an_embedding_crosses_a_pickle_unchanged():
    embedding = np.linspace(-1, 1, 7, dtype=np.float32)
    outputs = EngineOutputs([EngineOutput("e", [3], FinishReason.LENGTH, 5, embedding=embedding)])
    crossed = pickle.loads(pickle.dumps(outputs)).outputs[0]
    assert crossed == outputs.outputs[0]
    assert crossed.embedding.dtype == np.float32 and np.array_equal(crossed.embedding, embedding)


def test_prompt_logprobs_cross_a_pickle_unchanged():
    scored = PromptLogprobs(
        token_logprobs=np.array([-1.5, -0.25], dtype=np.float32),
        ranks=np.array([3, 1]),
        top_token_ids=np.array([[7], [9]]),
        top_logprobs=np.array([[-0.5], [-0.25]], dtype=np.float32),
    )
    outputs = EngineOutputs([EngineOutput("p", [3], None, 3, prompt_logprobs=scored)])
    crossed = pickle.loads(pickle.dumps(outputs)).outputs[0].prompt_logprobs
    for field in ("token_logprobs", "ranks", "top_token_ids", "top_logprobs"):
        assert np.array_equal(getattr(crossed, field), getattr(scored, field)), field
