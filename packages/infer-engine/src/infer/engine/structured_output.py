"""The scheduler's side of structured output: a grammar matcher per constrained request, the
bitmask of what each may sample this step, and each matcher moved past the tokens its request
takes (`Scheduler.add`, `grammar_masks`, `update`).

The grammar compiler (the tokenizer's llguidance view: ~0.3 s for SmolLM2, ~3 s for Gemma 3's
262k tokens) is built when the first constrained request arrives, so an engine that never sees
one never pays for it; that first request (and the core's loop) waits for it once. Masks are
filled on the host into one of two pinned buffers (a step's copy to the device may still be
queued when the next step fills the other) while the device runs the step's forward
(the core asks for them between `ModelRunner.launch`, which queues it, and `ModelRunner.sample`).
"""

from collections.abc import Collection, Sequence

import torch

from infer.engine.grammar import GrammarCompiler, GrammarMatcher
from infer.engine.grammar_spec import GrammarSpec
from infer.engine.sampler import AllowedTokens


class StructuredOutput:
    """The constrained requests' matchers, by request id (see the module)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Collection[int], device, max_rows: int):
        self.device = torch.device(device)
        self.max_rows = max_rows
        self._tokenizer_view = (hf_tokenizer, vocab_size, tuple(eos_token_ids))
        self._compiler: GrammarCompiler | None = None
        self._matchers: dict[str, GrammarMatcher] = {}
        self._bitmasks: list[torch.Tensor] = []
        self._num_filled = 0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(*self._tokenizer_view)
        return self._compiler

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A matcher at the grammar's start; GrammarSpecError when it cannot be enforced."""
        return self.compiler.compile(spec).matcher()

    def add(self, request_id: str, matcher: GrammarMatcher) -> None:
        """Constrains the request's sampling by `matcher` from its next step on."""
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def constrains_any(self, request_ids: Collection[str]) -> bool:
        return bool(self._matchers) and any(request_id in self._matchers for request_id in request_ids)

    def allowed(
        self, sampling_ids: Sequence[str], drafts: Sequence[Sequence[int]] = ()
    ) -> AllowedTokens | None:
        """The allowed tokens of the constrained requests among a step's sampling rows (row i of
        the step's logits is sampling_ids[i]); None when none is constrained. With `drafts` (per
        sampling id, the draft tokens it verifies), request i has len(drafts[i]) + 1 logits rows,
        back to back, and its mask at row j is its grammar's state after drafts[i][:j]."""
        # A matcher that died (it refused a token: update() fails its request)
        # allows nothing: its row samples unconstrained, and the token is dropped. (One that
        # stopped, the output complete, allows EOS: it stays.)
        drafts = drafts or [()] * len(sampling_ids)
        first_row = 0
        rows: list[tuple[int, str, tuple[int, ...]]] = []  # (first logits row, request, drafts)
        for request_id, request_drafts in zip(sampling_ids, drafts, strict=True):
            matcher = self._matchers.get(request_id)
            if matcher is not None and not matcher.is_dead:
                rows.append((first_row, request_id, tuple(request_drafts)))
            first_row += len(request_drafts) + 1
        if not rows:
            return None
        num_masks = sum(len(request_drafts) + 1 for _, _, request_drafts in rows)
        if not self._bitmasks or self._bitmasks[0].shape[0] < num_masks:
            size = max(self.max_rows, num_masks)
            self._bitmasks = [self.compiler.allocate_bitmask(size) for _ in range(2)]
        bitmask = self._bitmasks[self._num_filled % 2][:num_masks]
        self._num_filled += 1
        logits_rows = []
        for first, request_id, request_drafts in rows:
            matcher = self._matchers[request_id]
            for j in range(len(request_drafts) + 1):
                matcher.fill_bitmask(bitmask, len(logits_rows))
                logits_rows.append(first + j)
                if j < len(request_drafts):
                    matcher.advance(request_drafts[j])  # valid_drafts let only allowed ones through
            if request_drafts:
                matcher.rollback(len(request_drafts))
        rows = logits_rows
        return AllowedTokens(
            bitmask.to(self.device, non_blocking=True),
            torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True),
        )

    def valid_drafts(self, request_id: str, drafts: Sequence[int]) -> tuple[int, ...]:
        """The longest prefix of `drafts` the request's grammar allows (all of them for a request
        without one); the matcher is left where it was."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_dead:
            return tuple(drafts)
        if not self._bitmasks:
            self._bitmasks = [self.compiler.allocate_bitmask(self.max_rows) for _ in range(2)]
        # A row of the buffer the next allowed() fills: the last one handed out stays intact.
        scratch = self._bitmasks[self._num_filled % 2]
        kept: list[int] = []
        for token_id in drafts:
            matcher.fill_bitmask(scratch, 0)
            word = int(scratch[0, token_id // 32]) & 0xFFFFFFFF
            if not (word >> (token_id % 32)) & 1:
                break
            matcher.advance(token_id)
            kept.append(token_id)
        if kept:
            matcher.rollback(len(kept))
        return tuple(kept)

    def advance(self, request_id: str, token_ids: Sequence[int]) -> int | None:
        """Moves the request's matcher past its new tokens; the index of the first one it
        refuses, or None (also for a request without a grammar)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        for index, token_id in enumerate(token_ids):
            if not matcher.advance(token_id):
                return index
        return None
