"""When a request ends, and which text it may show before it does.

The rules are split where the process boundary is: the core decides on token ids alone
(`token_finish_reason`: an EOS token or a stop token id, or max_new_tokens), the frontend on text
(`StopChecker`: the detokenizer's text through `StopStringMatcher`, which works on text alone:
stop strings may span several tokens, so it holds back the longest tail of the pending text
that could still grow into a stop string, and never emits the stop string or anything after
it). A stop string found by the frontend ends the request there, and the frontend aborts it in
the core.
"""

from collections.abc import Collection, Sequence
from typing import Protocol

from infer.engine.protocol import FINISH_LENGTH, FINISH_STOP, FinishReason
from infer.engine.sampling_params import SamplingParams


class StopStringMatcher:
    """Feed text deltas; get back the text that is safe to show and whether a stop string ended it."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [text for text in stop if text]
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text to emit now, stopped). After a stop, further pushes emit nothing."""
        if self.stopped:
            return "", True
        self.pending += delta
        if not self.stop:
            emitted, self.pending = self.pending, ""
            return emitted, False
        # Invariant: every stop string that could still complete starts inside `pending`, so the
        # earliest occurrence found here is the earliest one in the whole output.
        found = [(index, text) for text in self.stop if (index := self.pending.find(text)) >= 0]
        if found:
            index, self.matched = min(found, key=lambda match: match[0])
            emitted = self.pending[:index]
            self.pending = ""
            self.stopped = True
            return emitted, True
        held = self._longest_partial_match()
        emitted = self.pending[: len(self.pending) - held]
        self.pending = self.pending[len(emitted) :]
        return emitted, False

    def flush(self) -> str:
        """The held-back text, once no more text will come (a partial match is not a stop)."""
        if self.stopped:
            return ""
        emitted, self.pending = self.pending, ""
        return emitted

    def _longest_partial_match(self) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of some stop string."""
        longest = 0
        for text in self.stop:
            for length in range(min(len(text) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(text[:length]):
                    longest = length
                    break
        return longest


class Detokenizer(Protocol):
    """What StopChecker needs from `infer.models.IncrementalDetokenizer`."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


def stop_token_ids_of(params: SamplingParams, eos_token_ids: Collection[int]) -> frozenset[int]:
    """The ids that end a request: its own stop_token_ids, and the model's EOS set unless
    ignore_eos (which never ignores the request's own stop_token_ids)."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))


def token_finish_reason(
    params: SamplingParams, stop_token_ids: Collection[int], num_generated: int, token_id: int
) -> FinishReason | None:
    """The core's stop rules for the `num_generated`-th token (1-based): a stop token ends the
    request once min_tokens are out (the sampler keeps them out until then), max_new_tokens ends
    it at length. Stop strings are text: the frontend's StopChecker looks for them."""
    if num_generated > params.min_tokens and token_id in stop_token_ids:
        return FinishReason.STOP
    if num_generated >= params.max_new_tokens:
        return FinishReason.LENGTH
    return None


class StopChecker:
    """One request's text, token by token in the order they were generated: the detokenizer's
    text through the stop-string matcher, and the finish reason the text decides. `push` takes
    the core's verdict on the same token (`token_finish_reason`): STOP means the token is a stop
    token, whose own text is never shown; LENGTH means it is the last one."""

    def __init__(self, params: SamplingParams, detokenizer: Detokenizer):
        self.params = params
        self.detokenizer = detokenizer
        self.matcher = StopStringMatcher(params.stop)
        self.num_generated = 0
        self.finish_reason: str | None = None

    def push(self, token_id: int, core_finish: FinishReason | None = None) -> tuple[str, str | None]:
        """Returns (text to emit for this token, finish reason or None while the request goes on)."""
        if self.finish_reason is not None:
            raise RuntimeError(f"token {token_id} pushed after the request finished ({self.finish_reason})")
        self.num_generated += 1
        if core_finish is FinishReason.STOP:
            # Text held for a stop string is released (or completes one).
            return self._finish(FINISH_STOP, tail=self.detokenizer.flush())
        if self.num_generated <= self.params.min_tokens:
            # Stop strings are looked for from the token after min_tokens on; the text goes out
            # as it comes.
            text = self.detokenizer.push(token_id)
            if core_finish is FinishReason.LENGTH:
                self.finish_reason = FINISH_LENGTH
                return text + self.detokenizer.flush(), FINISH_LENGTH
            return text, None
        emitted, stopped = self.matcher.push(self.detokenizer.push(token_id))
        if stopped:
            self.finish_reason = FINISH_STOP
            return emitted, FINISH_STOP
        if core_finish is FinishReason.LENGTH:
            text, reason = self._finish(FINISH_LENGTH, tail=self.detokenizer.flush())
            return emitted + text, reason
        return emitted, None

    def _finish(self, reason: str, *, tail: str) -> tuple[str, str]:
        emitted, stopped = self.matcher.push(tail)
        self.finish_reason = FINISH_STOP if stopped else reason
        return emitted + self.matcher.flush(), self.finish_reason
