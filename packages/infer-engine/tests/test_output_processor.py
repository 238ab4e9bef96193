"""The frontend's text from the core's token ids (OutputProcessor), and the races between the two
sides: a stop string found by the frontend while the core goes on, an abort that crosses a
finish. The oracle for text is the tokenizer's own decode of the ids, cut at the stop string."""

import pytest

from infer.engine import (
    Engine,
    EngineConfig,
    EngineOutput,
    EngineOutputs,
    FinishReason,
    OutputProcessor,
    SamplingParams,
)
from infer.models.loader.fetch import fetch_model
from infer.models.loader.tokenizer import Tokenizer

TEXT = "The capital of France is Paris. It is known for the Eiffel Tower."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(fetch_model("smollm2-135m-instruct"))


def token_outputs(request_id: str, token_ids: list[int], finish_at_end: FinishReason | None = None):
    """One EngineOutputs per token, as the core sends a decode a step."""
    steps = []
    for index, token_id in enumerate(token_ids):
        finish = finish_at_end if index == len(token_ids) - 1 else None
        steps.append(EngineOutputs([EngineOutput(request_id, [token_id], finish, num_prompt_tokens=3)]))
    return steps


def test_a_stop_string_ends_the_request_in_the_frontend_and_asks_once_for_the_core_to_abort(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    text = tokenizer.decode(token_ids)
    processor = OutputProcessor(tokenizer)
    processor.add("a", [1, 2, 3], SamplingParams(max_new_tokens=100, stop=["Tower", "Eiffel", "Rome"]))
    outputs, aborts = [], []
    # The core knows nothing of the stop string: it sends every token, and its abort comes late.
    for engine_outputs in [
        *token_outputs("a", token_ids),
        EngineOutputs([EngineOutput("a", [], FinishReason.ABORT, 3)]),
    ]:
        step_outputs, stopped = processor.process(engine_outputs)
        outputs += step_outputs
        aborts += stopped
    assert aborts == ["a"]
    assert "".join(output.text_delta for output in outputs) == text[: text.find("Eiffel")]
    finals = [output for output in outputs if output.finished]
    assert len(finals) == 1 and finals[0] is outputs[-1]
    assert finals[0].finish_reason == "stop" and finals[0].error is None
    # The earliest stop string in the text, whatever its place in the list.
    assert finals[0].stop_string == "Eiffel"
    assert [output.stop_string for output in outputs[:-1]] == [None] * (len(outputs) - 1)
    assert finals[0].completion_tokens == len(outputs)
    assert "a" not in processor


def test_the_last_token_of_a_core_stop_is_hidden_and_of_a_length_finish_shown(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for finish, shown_ids in ((FinishReason.STOP, token_ids[:-1]), (FinishReason.LENGTH, token_ids)):
        processor = OutputProcessor(tokenizer)
        processor.add("a", [1], SamplingParams(max_new_tokens=len(token_ids)))
        outputs = [
            out for step in token_outputs("a", token_ids, finish) for out in processor.process(step)[0]
        ]
        assert "".join(output.text_delta for output in outputs) == tokenizer.decode(shown_ids)
        assert [output.finished for output in outputs] == [False] * (len(token_ids) - 1) + [True]
        assert outputs[-1].finish_reason == str(finish)
        assert outputs[-1].stop_string is None


def test_an_abort_that_crosses_a_finish_gives_one_final_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add("a", [1], SamplingParams(max_new_tokens=1))
    # The frontend asked for the abort while the core was finishing the request: the core sends
    # the finish, and nothing for the abort of a request it no longer has; were it to send an
    # abort too, it is dropped.
    finished = EngineOutputs([EngineOutput("a", [42], FinishReason.LENGTH, 1)])
    aborted = EngineOutputs([EngineOutput("a", [], FinishReason.ABORT, 1)])
    outputs = processor.process(finished)[0] + processor.process(aborted)[0]
    assert [(output.finished, output.finish_reason) for output in outputs] == [(True, "length")]


def test_a_refused_request_ends_with_its_error(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add("a", [1], SamplingParams())
    (output,), aborts = processor.process(
        EngineOutputs([EngineOutput("a", [], FinishReason.ERROR, 1, error="QueueFullError: full")])
    )
    assert output.finished and output.finish_reason is None and output.error == "QueueFullError: full"
    assert aborts == []


def test_aborts_racing_finishes_in_an_engine_process_end_each_request_once(tiny_checkpoints):
    """On real processes: each request is aborted right after it is sent, or after its first
    token, while the core in its child process may be finishing it. Every request ends exactly
    once, by its length or by the abort, never with an error, and the core ends idle."""
    config = EngineConfig(model=str(tiny_checkpoints["llama-tiny"]), max_seq_len=64, max_batch_size=4)
    engine = Engine.spawn(config)
    try:
        finals: dict[str, list] = {}
        for attempt in range(24):
            max_new_tokens = 1 + attempt % 3
            request_id = engine.add_request(
                [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
            )
            abort_after_first_token = attempt % 2 == 1
            if not abort_after_first_token:
                engine.abort(request_id)
            while request_id not in finals:
                for output in engine.step(wait_s=5.0):
                    if output.finished:
                        finals.setdefault(output.request_id, []).append(output)
                    elif abort_after_first_token and output.request_id == request_id:
                        engine.abort(request_id)
        assert all(len(ends) == 1 for ends in finals.values()), finals
        reasons = {ends[0].finish_reason for ends in finals.values()}
        assert reasons <= {"length", "abort"}, reasons
        assert all(ends[0].error is None for ends in finals.values())
        # Which side wins each race above is the machine's to decide; an abort that comes long
        # before the end must win.
        long_id = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
        long_outputs = []
        while not (long_outputs and long_outputs[-1].finished):
            long_outputs += [output for output in engine.step(wait_s=5.0) if output.request_id == long_id]
            if len(long_outputs) == 1:
                engine.abort(long_id)
        assert long_outputs[-1].finish_reason == "abort" and len(long_outputs) < 41
        # Nothing more arrives for them, and the core (its heartbeat's statistics) is idle.
        late = [output for _ in range(3) for output in engine.step(wait_s=1.0)]
        assert late == []
        stats = engine.stats()
        assert stats.num_running == stats.num_waiting == stats.kv_bytes_used == 0, stats
        assert engine.abort(long_id) is False
    finally:
        engine.shutdown()
