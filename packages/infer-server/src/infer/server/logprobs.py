"""A choice's `logprobs` in the OpenAI format of its endpoint, from the engine's TokenLogprobs.

/v1/chat/completions (`logprobs: true`, `top_logprobs: k`):
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"} x k]}],
     "refusal": null}
/v1/completions (`logprobs: k`, OpenAI's legacy format):
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
     "text_offset": [...]}; each dict holds the k most likely tokens and the sampled one (so up
    to k + 1 entries, as OpenAI documents).

With `echo` (completions) the lists cover the prompt's tokens first: the first prompt token has
no logprob and no alternatives (null), each other one its logprob under the model's
distribution at the position before it (the engine's PromptLogprobs). vLLM's `prompt_logprobs`
field (both endpoints) is its own shape: per prompt token, null for the first, else
{token id: {"logprob", "rank", "decoded_token"}} for the token and the k most likely there.

A streamed choice renders each chunk's tokens as they come; the completions format's text
offsets run on across chunks. As in vLLM, a token's text is the token decoded alone (a piece of a
multi-byte character reads U+FFFD), `bytes` is that text in UTF-8, and text offsets add up those
texts. The values are the model's raw logprobs (see `infer.engine.sampler`), floored at -9999
so that JSON can carry them (vLLM's floor).
"""

from collections.abc import Sequence
from typing import Any

from infer.engine.protocol import PromptLogprobs, TokenLogprobs

# JSON has no -Infinity: a token the model rules out entirely reads this.
MIN_LOGPROB = -9999.0


class ChoiceLogprobs:
    """One choice's logprobs, chunk by chunk (a whole body is one chunk)."""

    def __init__(self, tokenizer, *, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat
        # Where the next token's text starts in the choice's text (the completions format).
        self.text_offset = 0

    def render(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
        """The `logprobs` object of a choice (or chunk) holding these tokens (None: an echoed
        prompt's first token, completions only)."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"one TokenLogprobs per token: {len(logprobs)} for {len(token_ids)} tokens")
        if self.chat:
            return {
                "content": [
                    self._chat_entry(token_id, entry)
                    for token_id, entry in zip(token_ids, logprobs, strict=True)
                ],
                "refusal": None,
            }
        tokens = [self._text(token_id) for token_id in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        top_logprobs = []
        for token, entry in zip(tokens, logprobs, strict=True):
            if entry is None:  # an echoed prompt's first token: nothing before it predicts it
                top_logprobs.append(None)
                continue
            alternatives = {
                self._text(token_id): _floored(value)
                for token_id, value in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
            }
            alternatives[token] = _floored(entry.logprob)
            top_logprobs.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": [None if entry is None else _floored(entry.logprob) for entry in logprobs],
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def render_echoed(
        self,
        prompt_ids: Sequence[int],
        scored: PromptLogprobs,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs],
        num_top: int,
    ) -> dict[str, Any]:
        """The completions `logprobs` object of an echoed choice: its prompt's tokens (`scored`,
        `num_top` alternatives each), then its generated ones."""
        if len(scored) != len(prompt_ids) - 1:
            raise ValueError(
                f"prompt logprobs for {len(scored) + 1} tokens, the prompt has {len(prompt_ids)}"
            )
        prompt = [None] + [
            TokenLogprobs(float(value), top_ids[:num_top].tolist(), top_values[:num_top].tolist())
            for value, top_ids, top_values in zip(
                scored.token_logprobs, scored.top_token_ids, scored.top_logprobs, strict=True
            )
        ]
        parts = [self.render(prompt_ids, prompt), self.render(token_ids, logprobs)]
        return {key: parts[0][key] + parts[1][key] for key in parts[0]}

    def _chat_entry(self, token_id: int, entry: TokenLogprobs) -> dict[str, Any]:
        return {
            **self._chat_token(token_id, entry.logprob),
            "top_logprobs": [
                self._chat_token(top_id, value)
                for top_id, value in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
            ],
        }

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": _floored(logprob), "bytes": list(text.encode("utf-8"))}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _floored(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def prompt_logprobs_field(
    tokenizer, prompt_ids: Sequence[int], scored: PromptLogprobs, num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id:
    {"logprob", "rank", "decoded_token"}} for the token itself and the `num_top` most likely
    tokens there (ranks 1..num_top; the token once if it is one of them)."""
    if len(scored) != len(prompt_ids) - 1:
        raise ValueError(f"prompt logprobs for {len(scored) + 1} tokens, the prompt has {len(prompt_ids)}")
    entries: list[dict[str, dict[str, Any]] | None] = [None]
    for token_id, value, rank, top_ids, top_values in zip(
        prompt_ids[1:],
        scored.token_logprobs,
        scored.ranks,
        scored.top_token_ids,
        scored.top_logprobs,
        strict=True,
    ):
        ranked = [(int(token_id), float(value), int(rank))]
        top = zip(top_ids[:num_top].tolist(), top_values[:num_top].tolist(), strict=True)
        ranked += [(top_id, top_value, top_rank) for top_rank, (top_id, top_value) in enumerate(top, 1)]
        entry: dict[str, dict[str, Any]] = {}
        for ranked_id, ranked_value, ranked_rank in ranked:
            entry.setdefault(
                str(ranked_id),
                {
                    "logprob": _floored(ranked_value),
                    "rank": ranked_rank,
                    "decoded_token": tokenizer.decode([ranked_id]),
                },
            )
        entries.append(entry)
    return entries
