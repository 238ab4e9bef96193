"""The frontend's half of generation: token ids from the core -> text, per request.

`OutputProcessor` keeps, for each request the frontend sent and has not seen end, an incremental
detokenizer and the stop-string rules (`infer.engine.stop.StopChecker`). It turns each step's
`EngineOutputs` into one `StepOutput` per token (the text that token releases), plus the final
word of requests that were aborted or failed. A stop string ends a request here, before the core
knows: `process` returns those ids, for the caller to abort them in the core, and whatever the
core still sends for them is dropped.

It runs in the frontend's process, wherever the core runs (vLLM's output processor does the same
job): the core stays free of text, and the detokenizer's Python work stays off the core's loop.
It lives in infer-engine, not infer-server, because `infer generate` makes text too.
"""

from dataclasses import dataclass, field

import numpy as np

from infer.engine.protocol import (
    FINISH_ABORT,
    EngineOutput,
    EngineOutputs,
    FinishReason,
    PromptLogprobs,
    TokenLogprobs,
)
from infer.engine.sampling_params import SamplingParams
from infer.engine.stop import StopChecker


# One is made for every token every request gets: slots and no frozen __setattr__ (as the
# core's EngineOutput) made that 2.75 -> 0.87 us on the 2-core VM (timeit, 2026-11-30).
@dataclass(slots=True)
class StepOutput:
    """One new token of one request (or its final word: an abort or a failure carries no token)."""

    request_id: str
    token_id: int | None
    # Text this token releases; "" while a multi-byte character or a possible stop string is pending.
    text_delta: str
    finished: bool
    # "stop" | "length" | "abort" when finished normally; None while running and on failure.
    finish_reason: str | None
    # Set when the request failed: why the core refused it or its batch's forward raised.
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    # On a request's first token: seconds from add_request to the step that first scheduled it.
    # A measurement, not part of what was generated: outputs compare equal without it.
    queue_time_s: float | None = field(default=None, compare=False)
    # The token's logprob and alternatives, when the request asked for them.
    logprobs: TokenLogprobs | None = None
    # On the first token of a request with images: seconds the vision tower spent on them. A
    # measurement, as queue_time_s.
    vision_encoder_s: float | None = field(default=None, compare=False)
    # Prompt tokens the prefix cache served instead of the forward (usage's cached_tokens). How
    # the answer was computed, not what it is: outputs compare equal without it.
    cached_tokens: int = field(default=0, compare=False)
    # On the final output of a request a stop string ended: that string (vLLM's `stop_reason`;
    # Anthropic's `stop_sequence`). None otherwise, a stop token or EOS included.
    stop_string: str | None = None
    # A pooling request's pooled hidden state (EngineOutput.embedding), on its one output.
    embedding: np.ndarray | None = field(default=None, compare=False)
    # The prompt's logprobs (EngineOutput.prompt_logprobs), on the request's first token.
    prompt_logprobs: PromptLogprobs | None = field(default=None, compare=False)


class _RequestText:
    """One live request's text state."""

    def __init__(self, request_id: str, stop_checker: StopChecker):
        self.request_id = request_id
        self.stop_checker = stop_checker
        self.num_generated = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestText] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_live(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Starts tracking a request; call before the core can answer for it."""
        from infer.models.loader.tokenizer import IncrementalDetokenizer

        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids)
        self._requests[request_id] = _RequestText(request_id, StopChecker(params, detokenizer))

    def forget(self, request_id: str) -> None:
        """Stops tracking a request the core never took (it could not be sent)."""
        self._requests.pop(request_id, None)

    def process(self, engine_outputs: EngineOutputs) -> tuple[list[StepOutput], list[str]]:
        """(a StepOutput per token and per final word, in order; the ids of requests a stop
        string ended, which the caller aborts in the core)."""
        step_outputs: list[StepOutput] = []
        stopped_by_text: list[str] = []
        for output in engine_outputs.outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue  # ended here already (a stop string, an abort the core answers late)
            ended = self._process_one(state, output, step_outputs)
            if ended:
                del self._requests[output.request_id]
                if not output.finished:  # the text ended it; the core would go on
                    stopped_by_text.append(output.request_id)
        return step_outputs, stopped_by_text

    def _process_one(self, state: _RequestText, output: EngineOutput, step_outputs: list[StepOutput]) -> bool:
        """Appends the StepOutputs of `output`; True when the request ended."""
        last = len(output.new_token_ids) - 1
        for index, token_id in enumerate(output.new_token_ids):
            core_finish = output.finish_reason if index == last else None
            text, finish_reason = state.stop_checker.push(token_id, core_finish)
            state.num_generated += 1
            step_outputs.append(
                StepOutput(
                    request_id=state.request_id,
                    token_id=token_id,
                    text_delta=text,
                    finished=finish_reason is not None,
                    finish_reason=finish_reason,
                    error=None,
                    prompt_tokens=output.num_prompt_tokens,
                    completion_tokens=state.num_generated,
                    queue_time_s=output.queue_time_s if index == 0 else None,
                    vision_encoder_s=output.vision_encoder_s if index == 0 else None,
                    logprobs=output.logprobs[index] if output.logprobs is not None else None,
                    cached_tokens=output.num_cached_tokens,
                    stop_string=state.stop_checker.matcher.matched if finish_reason is not None else None,
                    embedding=output.embedding if index == last else None,
                    prompt_logprobs=output.prompt_logprobs if index == 0 else None,
                )
            )
            if finish_reason is not None:
                return True
        if output.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            error = output.error if output.finish_reason is FinishReason.ERROR else None
            step_outputs.append(
                StepOutput(
                    request_id=state.request_id,
                    token_id=None,
                    text_delta="",
                    finished=True,
                    finish_reason=None if error is not None else FINISH_ABORT,
                    error=error,
                    prompt_tokens=output.num_prompt_tokens,
                    completion_tokens=state.num_generated,
                    cached_tokens=output.num_cached_tokens,
                )
            )
            return True
        return False
