"""The fp8 KV cache (infer.kernels.kv_fp8) against a cache in the model's own dtype: the same
model and prompts, only the pool's dtype differs.

Two measures, both over the case's prompts, each followed by 64 greedy tokens:
- logits: the whole sequence (prompt and the reference run's 64 tokens) in one forward over each
  pool; every position's keys and values are read back from the pool, so every logit sees the
  cache's rounding. Judged by max/mean |difference| and top-1 agreement (the case's fp8 bounds).
- greedy agreement: each pool decodes 64 tokens for every prompt, the prompts a row each of one
  batch (as the engine runs them; a third of the forwards of one at a time), a token a row a
  step; each prompt's leading tokens that agree are reported, and where the runs first part the
  reference's logits of the two tokens must be within the case's `greedy_tie` (a near tie that
  the fp8 rounding may break either way).

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
    prompts = [tokenizer(prompt).input_ids for prompt in case["prompts"]]
    with torch.no_grad():
        references = greedy(ours, prompts, None, case["block_size"])
        fp8_runs = greedy(ours, prompts, torch.float8_e4m3fn, case["block_size"])
        sequences = [ids + reference for ids, (reference, _) in zip(prompts, references, strict=True)]
        gaps.add(
            sequence_logits(ours, sequences, torch.float8_e4m3fn, case["block_size"]),
            sequence_logits(ours, sequences, None, case["block_size"]),
        )
        for prompt, ids, (reference, reference_logits), (fp8, _) in zip(
            case["prompts"], prompts, references, fp8_runs, strict=True
        ):
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


def pool_and_blocks(
    model, lengths: list[int], kv_dtype, block_size: int
) -> tuple[PagedKVPool, list[list[int]]]:
    """A pool of `kv_dtype` (None: the model's) and, for each sequence of up to lengths[i]
    tokens, the blocks it holds there."""
    config = model.config
    dtype = kv_dtype or model.embed_tokens.weight.dtype
    shape = KVCacheShape(config.num_layers, model.num_kv_heads, config.head_dim, dtype, block_size)
    needed = [shape.blocks_for_tokens(n) for n in lengths]
    pool = PagedKVPool(shape, sum(needed), model.embed_tokens.weight.device)
    return pool, [pool.allocator.allocate(n, f"sequence {i}") for i, n in enumerate(needed)]


def sequence_logits(model, sequences: list[list[int]], kv_dtype, block_size: int) -> torch.Tensor:
    """[total tokens, vocab] fp32 logits of one forward over all `sequences`, each in its own
    blocks of a fresh pool of `kv_dtype`."""
    pool, blocks = pool_and_blocks(model, [len(s) for s in sequences], kv_dtype, block_size)
    rows = [PagedRow(row_blocks, 0, sequence) for row_blocks, sequence in zip(blocks, sequences, strict=True)]
    return model.compute_logits(model(paged_batch(pool, rows))).float()


def greedy(
    model, prompts: list[list[int]], kv_dtype, block_size: int
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """GREEDY_TOKENS greedy tokens for each prompt over a pool of `kv_dtype`, the prompts decoded
    together (a row each, as the engine batches them; each reads only its own blocks): the
    prompts in one forward, then a token a row a step. For each prompt, its tokens and the logits
    each was chosen from."""
    pool, blocks = pool_and_blocks(model, [len(ids) + GREEDY_TOKENS for ids in prompts], kv_dtype, block_size)
    runs = [([], []) for _ in prompts]
    cached, new = [0] * len(prompts), [list(ids) for ids in prompts]
    for _ in range(GREEDY_TOKENS):
        rows = [PagedRow(b, c, n) for b, c, n in zip(blocks, cached, new, strict=True)]
        hidden = model(paged_batch(pool, rows))
        last = torch.tensor([len(n) for n in new]).cumsum(0) - 1
        logits = model.compute_logits(hidden[last.to(hidden.device)]).float()
        for i, (tokens, chosen_from) in enumerate(runs):
            chosen_from.append(logits[i])
            tokens.append(int(logits[i].argmax()))
            cached[i], new[i] = cached[i] + len(new[i]), [tokens[-1]]
    return runs
