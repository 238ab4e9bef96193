"""Choosing the next token of every row of a batch of logits, each row with its own SamplingParams.

Pipeline, in this order (the order of transformers' logits processors, so that `generate` with
the same settings is a valid oracle):

    logit bias -> min_tokens bans -> repetition penalty -> presence / frequency penalties
    -> allowed tokens (grammars) -> temperature (below 1e-5: greedy argmax) -> top-k -> top-p
    -> min-p -> draw

The logit bias and the three penalties come before the argmax, so they change greedy rows too.
A grammar's mask (`AllowedTokens`, for the rows that follow one) comes after them, so no bias can
bring back a token it forbids, and before every truncation, so top-k and top-p choose among the
allowed tokens only. Where the bans leave a row nothing its grammar allows (min_tokens banning the
EOS that is all a finished grammar allows), the grammar wins: the row keeps its raw logits masked
by the grammar alone. A batch with no such row pays nothing.

Logprobs (`compute_logprobs`, for the rows whose SamplingParams ask) are of the logits as the
model gave them, before any of these transforms: the model's own distribution, whatever the
request's temperature or penalties, which is vLLM's default ("raw_logprobs"). A batch where no
row asks computes none.

Each transform takes float32 logits [B, V] and one value per row, and returns new logits in
which removed tokens are -inf; a row whose value means "off" comes back unchanged. A transform
that no row uses is skipped, so a batch of plain greedy rows costs one argmax (infer.kernels'
on a GPU: torch's reduces a long row in few thread blocks). The per-row values
come as `SamplingTensors`, which the runner builds when its batch changes, not every step.
"""

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from infer.engine.sampling_params import SamplingParams
from infer.kernels import apply_token_bitmask, argmax

Tokens = torch.Tensor | Sequence[int]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A per-request RNG on `device`; None (the process-wide RNG) when there is no seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplingTensors:
    """A batch's sampling settings on the logits' device, built once per batch composition (the
    runner keeps them while the same requests sample in the same order) instead of every step.

    A setting no row uses is None, and its transform is skipped; per-setting tensors hold only
    the rows that draw (temperature above SAMPLING_EPS), in `sampled_rows` order.
    """

    num_rows: int
    # Every row's penalty (1.0: off); None when no row uses one.
    repetition_penalties: torch.Tensor | None  # [B]
    # Every row's presence and frequency penalties (0: off); None when no row uses either.
    presence_penalties: torch.Tensor | None  # [B]
    frequency_penalties: torch.Tensor | None  # [B]
    # Every (row, token id, bias) of the rows' logit_bias, flattened; None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # min_tokens: every (row, stop token id, the row's min_tokens) of the rows that have one;
    # None when no row has one.
    min_tokens_bans: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    sampled_rows: tuple[int, ...]
    sampled_rows_index: torch.Tensor | None  # [S] int64
    temperatures: torch.Tensor | None  # [S]
    top_ks: torch.Tensor | None  # [S]
    top_ps: torch.Tensor | None  # [S]
    min_ps: torch.Tensor | None  # [S]
    # One per sampled row: its own generator, or None for the process-wide RNG.
    generators: tuple[torch.Generator | None, ...]
    # The rows that asked for logprobs, and each one's number of alternatives; () when none did.
    logprobs_rows: tuple[int, ...] = ()
    num_top_logprobs: tuple[int, ...] = ()
    logprobs_rows_index: torch.Tensor | None = None  # [R] int64

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        eos_token_ids: Collection[int] = (),
    ) -> "SamplingTensors":
        """`eos_token_ids`: the model's EOS set, which min_tokens keeps out (unless ignore_eos)."""
        if len(params) != len(generators):
            raise ValueError(f"one generator per row: got {len(generators)} for {len(params)} rows")
        sampled_rows = tuple(row for row, p in enumerate(params) if not p.is_greedy)
        drawn = [params[row] for row in sampled_rows]
        logprobs_rows = tuple(row for row, p in enumerate(params) if p.logprobs is not None)

        def per_sampled_row(values: list, used: bool) -> torch.Tensor | None:
            return torch.tensor(values, device=device) if used else None

        uses_presence_or_frequency = any(p.presence_penalty or p.frequency_penalty for p in params)
        biases = [
            (row, token_id, bias) for row, p in enumerate(params) for token_id, bias in p.logit_bias.items()
        ]
        bans = [
            (row, token_id, p.min_tokens)
            for row, p in enumerate(params)
            if p.min_tokens
            for token_id in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))
        ]
        return cls(
            num_rows=len(params),
            repetition_penalties=(
                torch.tensor([p.repetition_penalty for p in params], device=device)
                if any(p.repetition_penalty != 1.0 for p in params)
                else None
            ),
            presence_penalties=(
                torch.tensor([p.presence_penalty for p in params], device=device)
                if uses_presence_or_frequency
                else None
            ),
            frequency_penalties=(
                torch.tensor([p.frequency_penalty for p in params], device=device)
                if uses_presence_or_frequency
                else None
            ),
            logit_bias=_columns(biases, device),
            min_tokens_bans=_columns(bans, device),
            sampled_rows=sampled_rows,
            sampled_rows_index=torch.tensor(sampled_rows, device=device) if sampled_rows else None,
            temperatures=per_sampled_row([p.temperature for p in drawn], bool(drawn)),
            top_ks=per_sampled_row([p.top_k for p in drawn], any(p.uses_top_k for p in drawn)),
            top_ps=per_sampled_row([p.top_p for p in drawn], any(p.top_p < 1.0 for p in drawn)),
            min_ps=per_sampled_row([p.min_p for p in drawn], any(p.min_p > 0.0 for p in drawn)),
            generators=tuple(generators[row] for row in sampled_rows),
            logprobs_rows=logprobs_rows,
            num_top_logprobs=tuple(params[row].logprobs for row in logprobs_rows),
            logprobs_rows_index=torch.tensor(logprobs_rows, device=device) if logprobs_rows else None,
        )

    @property
    def reads_token_ids(self) -> bool:
        """Whether `sample` needs each row's prompt + generated ids (the repetition penalty)."""
        return self.repetition_penalties is not None

    @property
    def reads_output_ids(self) -> bool:
        """Whether `sample` needs each row's generated ids (presence and frequency penalties,
        min_tokens)."""
        return self.presence_penalties is not None or self.min_tokens_bans is not None


def _columns(entries: list[tuple], device) -> tuple[torch.Tensor, ...] | None:
    """[(a, b, c), ...] as one tensor per position (a's, b's, c's); None for no entries."""
    if not entries:
        return None
    return tuple(torch.tensor(column, device=device) for column in zip(*entries, strict=True))


@dataclass(frozen=True)
class AllowedTokens:
    """The tokens some rows' grammars allow this step: bitmask row i (int32 words, bit t % 32 of
    word t // 32 set: token t allowed) is for logits row `rows[i]`. See apply_token_bitmask."""

    bitmask: torch.Tensor  # [R, words] int32
    rows: torch.Tensor  # [R] int64, distinct


def sample(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    token_ids: Sequence[Tokens] = (),
    output_ids: Sequence[Tokens] = (),
    allowed: AllowedTokens | None = None,
) -> torch.Tensor:
    """logits [B, V]; the batch's SamplingTensors; per row its prompt + generated ids (read only
    when `tensors.reads_token_ids`) and its generated ids (read only when
    `tensors.reads_output_ids`); the grammar-constrained rows' allowed tokens, if any. Returns
    [B] int64."""
    greedy_tokens, drawn_logits = target_logits(logits, tensors, token_ids, output_ids, allowed)
    if drawn_logits is None:
        return greedy_tokens
    probs = drawn_logits.softmax(dim=-1)
    # One draw per row from that row's own generator, so a seeded request gets the same tokens
    # whatever else shares its batch.
    drawn = torch.cat(
        [
            torch.multinomial(probs[i], 1, generator=generator)
            for i, generator in enumerate(tensors.generators)
        ]
    )
    return greedy_tokens.index_copy(0, tensors.sampled_rows_index, drawn)


def target_logits(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    token_ids: Sequence[Tokens] = (),
    output_ids: Sequence[Tokens] = (),
    allowed: AllowedTokens | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distribution each row draws from, as `sample`'s arguments: every row's argmax after
    the transforms that come before it ([B] int64, the token of the greedy rows), and the
    drawing rows' logits after every transform ([S, V], `tensors.sampled_rows` order; None when
    no row draws). Speculative decoding verifies draft tokens against these."""
    if logits.shape[0] != tensors.num_rows:
        raise ValueError(f"sampling settings for {tensors.num_rows} rows, logits have {logits.shape[0]}")
    raw = logits
    logits = logits.float()
    if tensors.logit_bias is not None:
        rows, token_ids_biased, biases = tensors.logit_bias
        logits = logits.index_put((rows, token_ids_biased), biases, accumulate=True)
    if tensors.min_tokens_bans is not None:
        if len(output_ids) != tensors.num_rows:
            raise ValueError(f"min_tokens needs one output list per row, got {len(output_ids)}")
        rows, banned_ids, min_tokens = tensors.min_tokens_bans
        num_generated = torch.tensor([len(ids) for ids in output_ids], device=logits.device)
        # -inf where the row is still short of its min_tokens, 0 (no change) where it is not.
        still_short = num_generated[rows] < min_tokens
        bans = torch.where(still_short, -torch.inf, 0.0).to(logits.dtype)
        logits = logits.index_put((rows, banned_ids), bans, accumulate=True)
    if tensors.repetition_penalties is not None:
        if len(token_ids) != tensors.num_rows:
            raise ValueError(f"the repetition penalty needs one token list per row, got {len(token_ids)}")
        logits = apply_repetition_penalty(logits, token_ids, tensors.repetition_penalties)
    if tensors.presence_penalties is not None:
        if len(output_ids) != tensors.num_rows:
            raise ValueError(
                f"presence/frequency penalties need one output list per row, got {len(output_ids)}"
            )
        logits = apply_presence_frequency_penalties(
            logits, output_ids, tensors.presence_penalties, tensors.frequency_penalties
        )
    if allowed is not None:
        # Only a min_tokens ban or an overflowing repetition penalty puts -inf in a row before
        # its mask; the other transforms add finite values, so without those rows cannot be left
        # with nothing, and the fallback is not built.
        can_ban = tensors.min_tokens_bans is not None or tensors.repetition_penalties is not None
        logits = apply_allowed_tokens(logits, raw, allowed, grammar_wins=can_ban)
    greedy_tokens = argmax(logits)
    if not tensors.sampled_rows:
        return greedy_tokens, None

    rows = tensors.sampled_rows_index
    logits = apply_temperature(logits[rows], tensors.temperatures)
    # A row's own extreme settings (a repetition penalty of 1e-39 divides its logits into
    # overflow) may leave +inf; as the largest finite float the row's softmax stays defined, so
    # one request can never make its batch's draw fail.
    logits = torch.nan_to_num(logits, nan=-torch.inf, posinf=torch.finfo(logits.dtype).max, neginf=-torch.inf)
    if tensors.top_ks is not None:
        logits = apply_top_k(logits, tensors.top_ks)
    if tensors.top_ps is not None:
        logits = apply_top_p(logits, tensors.top_ps)
    if tensors.min_ps is not None:
        logits = apply_min_p(logits, tensors.min_ps)
    return greedy_tokens, logits


def compute_logprobs(
    logits: torch.Tensor, sampled_token_ids: torch.Tensor, tensors: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the rows in `tensors.logprobs_rows`, in that order: the logprob of the token each
    sampled [R], and the ids [R, K] and logprobs [R, K] of its K most likely tokens, most likely
    first (K: the largest number of alternatives a row asked for; a row keeps its own first ones).
    `logits` [B, V] as the model gave them (see the module docstring); `sampled_token_ids` [B]."""
    if tensors.logprobs_rows_index is None:
        raise ValueError("no row of this batch asked for logprobs")
    rows = tensors.logprobs_rows_index
    logprobs = logits[rows].float().log_softmax(dim=-1)
    sampled_logprobs = logprobs.gather(1, sampled_token_ids[rows, None]).squeeze(1)
    top = logprobs.topk(max(tensors.num_top_logprobs), dim=-1)
    return sampled_logprobs, top.indices, top.values


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Tokens],
    generators: Sequence[torch.Generator | None],
    output_ids: Sequence[Tokens] = (),
) -> torch.Tensor:
    """`sample` with the batch's tensors built for this call: logits [B, V]; per row its params,
    its prompt + generated ids, its generator, and (for presence/frequency penalties) its
    generated ids. Returns [B] int64."""
    if not len(params) == len(token_ids) == len(generators) == logits.shape[0]:
        raise ValueError(
            f"one params, token list and generator per logits row: got {len(params)}, {len(token_ids)}, "
            f"{len(generators)} for {logits.shape[0]} rows"
        )
    return sample(logits, SamplingTensors.build(params, generators, logits.device), token_ids, output_ids)


def apply_allowed_tokens(
    logits: torch.Tensor, raw: torch.Tensor, allowed: AllowedTokens, *, grammar_wins: bool = True
) -> torch.Tensor:
    """-inf for every token a constrained row's grammar does not allow. With `grammar_wins`, a
    row left with no allowed token (bans and grammar disagree) takes its raw logits under the
    grammar's mask alone, chosen on the device (no host sync)."""
    if logits is raw:  # never write into the caller's logits
        logits = logits.clone()
    apply_token_bitmask(logits, allowed.bitmask, allowed.rows)
    if not grammar_wins:
        return logits
    rows = allowed.rows
    grammar_only = raw[rows].float()
    apply_token_bitmask(grammar_only, allowed.bitmask, torch.arange(len(rows), device=rows.device))
    constrained = logits[rows]
    nothing_left = torch.isneginf(constrained).all(dim=-1, keepdim=True)
    logits[rows] = torch.where(nothing_left, grammar_only, constrained)
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor, token_ids: Sequence[Tokens], penalties: torch.Tensor
) -> torch.Tensor:
    """Every token id seen in the row: positive logit / penalty, negative logit * penalty (once per id)."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for row, ids in enumerate(token_ids):
        seen[row, torch.as_tensor(ids, dtype=torch.long, device=logits.device)] = True
    penalties = penalties[:, None].to(logits.dtype)
    penalized = torch.where(logits < 0, logits * penalties, logits / penalties)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor, output_ids: Sequence[Tokens], presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI's penalties over each row's generated ids: logit - frequency x count - presence x
    (count > 0), where count is how many times the row generated the token."""
    counts = torch.zeros_like(logits)
    for row, ids in enumerate(output_ids):
        ids = torch.as_tensor(ids, dtype=torch.long, device=logits.device)
        counts[row].index_add_(0, ids, torch.ones(len(ids), dtype=logits.dtype, device=logits.device))
    return (
        logits
        - frequency[:, None].to(logits.dtype) * counts
        - presence[:, None].to(logits.dtype) * (counts > 0)
    )


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Divide by the temperature; rows at 0 (greedy, chosen by argmax elsewhere) are left as they are."""
    divisors = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    return logits / divisors[:, None].to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th); k <= 0 is off."""
    vocab_size = logits.shape[-1]
    active = top_ks > 0
    k = torch.where(active, top_ks.clamp(max=vocab_size), torch.ones_like(top_ks))
    largest = logits.topk(int(k.max()), dim=-1).values
    kth_largest = largest.gather(1, (k - 1)[:, None])
    threshold = torch.where(active[:, None], kth_largest, torch.full_like(kth_largest, -torch.inf))
    return logits.masked_fill(logits < threshold, -torch.inf)


def apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose probabilities add up to at least top_p.

    As in transformers: sort ascending, drop tokens while the cumulative probability stays
    <= 1 - top_p, always keep the most probable token. top_p = 1 is off.
    """
    ascending, order = logits.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = (cumulative <= (1 - top_ps[:, None])) & (top_ps[:, None] < 1)
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return logits.masked_fill(remove, -torch.inf)


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most probable token's; 0 is off."""
    probs = logits.softmax(dim=-1)
    threshold = min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, -torch.inf)
