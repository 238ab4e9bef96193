"""The fp8 KV cache (infer.kernels.kv_fp8) against a cache in the model's own dtype: the same
model and prompts, only the pool's dtype differs.

Two measures, both over the case's prompts, each followed by 64 greedy tokens:
- logits: the whole sequence (prompt and the reference run's 64 tokens) in one forward over each
  pool; every position's keys and values are read back from the pool, so every logit sees the
  cache's rounding. Judged by max/mean |difference| and top-1 agreement (the case's fp8 bounds).
- greedy agreement: each pool decodes 64 tokens alone, a token a step; the leading tokens that
  agree are reported, and where the runs first part the reference's logits of the two tokens
  must be within the case's `greedy_tie` (a near tie that the fp8 rounding may break either way).

Each case's figures are printed (run with -s) and, with INFER_REPORT_DIR set, written there as
`fp8_kv-<case>.json`, for docs/benchmarks.
"""

import json
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer

from conformance.paged_batches import PagedRow, paged_batch
from infer.cache import KVCacheShape, PagedKVPool
from infer.models.load import load_causal_lm

GREEDY_TOKENS = 64


def fp8_kv_cache(case: dict, impl: str | None) -> None:
    # Here, not at the top: checks.py imports this module.
    from conformance.parity.checks import LogitGaps, _bounds, _checkpoint, _device

    bounds = _bounds(case)
    device = _device(case)
    folder = _checkpoint(case)
    ours = load_causal_lm(folder, dtype=getattr(torch, case["dtype"]), device=device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    gaps, agreed, report = LogitGaps(), [], []
    with torch.no_grad():
        for prompt in case["prompts"]:
            ids = tokenizer(prompt).input_ids
            reference, reference_logits = greedy(ours, ids, None, case["block_size"])
            fp8, _ = greedy(ours, ids, torch.float8_e4m3fn, case["block_size"])
            sequence = ids + reference
            gaps.add(
                sequence_logits(ours, sequence, torch.float8_e4m3fn, case["block_size"]),
                sequence_logits(ours, sequence, None, case["block_size"]),
            )
            first = next((i for i, (a, b) in enumerate(zip(fp8, reference, strict=True)) if a != b), None)
            agreed.append(GREEDY_TOKENS if first is None else first)
            tie = None
            if first is not None:
                logits = reference_logits[first]
                tie = (logits[reference[first]] - logits[fp8[first]]).item()
            report.append({"prompt_tokens": len(ids), "agreed_tokens": agreed[-1], "gap_at_parting": tie})
            assert tie is None or tie <= bounds["greedy_tie"], (
                f"prompt {prompt!r}: the fp8 cache's greedy tokens part from the {case['dtype']} cache's at "
                f"step {first}, where the latter's logits of the two differ by {tie:.3f}, more than "
                f"greedy_tie {bounds['greedy_tie']}: not a near tie"
            )
    summary = {
        "case": case["id"],
        "max_abs": gaps.max_abs,
        "mean_abs": gaps.abs_sum / gaps.count,
        "top1_agreement": gaps.agree / gaps.positions,
        "positions": gaps.positions,
        "greedy_tokens": GREEDY_TOKENS,
        "prompts": report,
    }
    print(f"fp8 KV, {json.dumps(summary)}")
    if os.environ.get("INFER_REPORT_DIR"):
        folder = Path(os.environ["INFER_REPORT_DIR"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"fp8_kv-{case['id']}.json").write_text(json.dumps(summary, indent=1))
    gaps.assert_within(bounds, "fp8 KV against the model's dtype: ")


def pool_for(model, num_tokens: int, kv_dtype: torch.dtype | None, block_size: int) -> PagedKVPool:
    """A pool of `kv_dtype` (None: the model's) for one sequence of up to num_tokens tokens."""
    config = model.config
    dtype = kv_dtype or model.embed_tokens.weight.dtype
    shape = KVCacheShape(config.num_layers, model.num_kv_heads, config.head_dim, dtype, block_size)
    return PagedKVPool(shape, shape.blocks_for_tokens(num_tokens), model.embed_tokens.weight.device)


def sequence_logits(model, sequence: list[int], kv_dtype, block_size: int) -> torch.Tensor:
    """[len(sequence), vocab] fp32 logits of one forward over a fresh pool of `kv_dtype`."""
    pool = pool_for(model, len(sequence), kv_dtype, block_size)
    blocks = pool.allocator.allocate(pool.num_blocks, "sequence")
    return model.compute_logits(model(paged_batch(pool, [PagedRow(blocks, 0, sequence)]))).float()


def greedy(model, ids: list[int], kv_dtype, block_size: int) -> tuple[list[int], list[torch.Tensor]]:
    """GREEDY_TOKENS greedy tokens over a pool of `kv_dtype`: the prompt in one forward, then a
    token a step; the tokens and the logits each was chosen from."""
    pool = pool_for(model, len(ids) + GREEDY_TOKENS, kv_dtype, block_size)
    blocks = pool.allocator.allocate(pool.num_blocks, "sequence")
    tokens, chosen_from, cached, new = [], [], 0, ids
    for _ in range(GREEDY_TOKENS):
        hidden = model(paged_batch(pool, [PagedRow(blocks, cached, new)]))
        logits = model.compute_logits(hidden[-1:])[0].float()
        chosen_from.append(logits)
        tokens.append(int(logits.argmax()))
        cached, new = cached + len(new), [tokens[-1]]
    return tokens, chosen_from
