"""When a request ends, and which text it may show before it does.

`StopStringMatcher` works on text alone: stop strings may span several tokens, so it holds back
the longest tail of the pending text that could still grow into a stop string, and never emits
the stop string or anything after it. `StopChecker` runs one request's generated tokens through
its detokenizer and the matcher, and decides the finish reason: "stop" (an EOS token, a stop
token id, a stop string) or "length" (max_new_tokens).
"""

from collections.abc import Collection, Sequence
from typing import Protocol

from infer.engine.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class StopStringMatcher:
    """Feed text deltas; get back the text that is safe to show and whether a stop string ended it."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [text for text in stop if text]
        self.pending = ""
        self.stopped = False

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
        found = [index for index in (self.pending.find(text) for text in self.stop) if index >= 0]
        if found:
            emitted = self.pending[: min(found)]
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


class StopChecker:
    """One request's stop rules, applied token by token in the order they were generated."""

    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int], detokenizer: Detokenizer):
        self.params = params
        # ignore_eos ignores the model's EOS set, never the request's own stop_token_ids.
        self.stop_token_ids = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(eos_token_ids)
        )
        self.detokenizer = detokenizer
        self.matcher = StopStringMatcher(params.stop)
        self.num_generated = 0
        self.finish_reason: str | None = None

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Returns (text to emit for this token, finish reason or None while the request goes on)."""
        if self.finish_reason is not None:
            raise RuntimeError(f"token {token_id} pushed after the request finished ({self.finish_reason})")
        self.num_generated += 1
        if self.num_generated <= self.params.min_tokens:
            # No stop yet (the sampler keeps stop tokens out until then); the text goes out as it
            # comes, and stop strings are looked for from the next token on.
            text = self.detokenizer.push(token_id)
            if self.num_generated >= self.params.max_new_tokens:
                self.finish_reason = FINISH_LENGTH
                return text + self.detokenizer.flush(), FINISH_LENGTH
            return text, None
        if token_id in self.stop_token_ids:
            # The stop token's own text is never shown; text held for a stop string is released.
            return self._finish(FINISH_STOP, tail=self.detokenizer.flush())
        emitted, stopped = self.matcher.push(self.detokenizer.push(token_id))
        if stopped:
            self.finish_reason = FINISH_STOP
            return emitted, FINISH_STOP
        if self.num_generated >= self.params.max_new_tokens:
            text, reason = self._finish(FINISH_LENGTH, tail=self.detokenizer.flush())
            return emitted + text, reason
        return emitted, None

    def _finish(self, reason: str, *, tail: str) -> tuple[str, str]:
        emitted, stopped = self.matcher.push(tail)
        self.finish_reason = FINISH_STOP if stopped else reason
        return emitted + self.matcher.flush(), self.finish_reason
