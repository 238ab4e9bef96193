"""Random walks through a grammar's allowed tokens, for tests that check where they end with an
oracle of their own (`jsonschema`, `re.fullmatch`, a tool format's parser)."""

import random

import torch


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids that one packed int32 bitmask row allows."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist()


def closing_token_ids(tokenizer, closers) -> frozenset[int]:
    """EOS and the tokens whose text holds one of `closers` (what may close a value)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    closing = {i for i, text in enumerate(texts) if any(c in text for c in closers)}
    return frozenset(closing | {tokenizer.eos_token_id})


def random_walk(
    compiler, spec, *, eos_token_id: int, closing_ids, seed: int, max_tokens: int, prefer_closing_after: int
) -> tuple[list[int], bool]:
    """Random allowed tokens from a fresh matcher of `spec`; after `prefer_closing_after` of them,
    only closing ones where any is allowed, so that walks end. Returns the ids and whether the
    walk reached EOS, which the grammar may allow only where the output can end."""
    rng = random.Random(seed)
    matcher = compiler.compile(spec).matcher()
    bitmask = compiler.allocate_bitmask(1)
    ids = []
    for step in range(max_tokens):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask[0], compiler.vocab_size)
        assert allowed, f"an empty mask after {ids}"
        if step > prefer_closing_after:
            allowed = [t for t in allowed if t in closing_ids] or allowed
        token = rng.choice(allowed)
        if token == eos_token_id:
            assert matcher.is_terminal, "EOS was allowed where the output may not end"
            return ids, True
        assert matcher.advance(token)
        ids.append(token)
    return ids, False
