"""Every tile and K-split choice of the GEMV family, by the shape of the product, with what
measured it: the 8-bit kernels' (`_gemv_config`, `_dot_config`), the dense and gated GEMV's
(`_dense_gemv_config`, `_gated_gemv_config`), the 4-bit kernels' (`_int4_gemv_config`,
`_int4_dot_config`, gemv.int4_mma's `_INT4_MMA_*`), the normed GEMVs' tiles, the K splits
(`_split_k` and `_k_split` for dense and 8-bit weights, `_int4_gemv_splits`, `_int4_k_per_split`
and `_int4_mma_splits` for 4-bit ones), and the rows of
x at which the launchers change kernels. The launchers (dense, quantized, int4_linear, normed)
read them; their `config` and `split_k` arguments override them for tests and sweeps.
"""

import triton

from infer.kernels._dispatch import num_sms

# Rows of x up to which the FMA kernel runs: on an H100 the tensor-core kernel was as fast from
# M = 2 (the FMA kernel re-reads the weight tile for each row of x).
# docs/benchmarks/quantization.md#gpu-decisions-what-chose-them has these and the tiles' figures.
_GEMV_MAX_M = 1
# Rows of x from which dequantizing the weight in one pass and handing it to cuBLAS beats the
# tensor-core kernel (prefill chunks). On an H100, summed over Qwen3-8B's four projections: fp8
# 516 against 654 µs at 512 rows, int8 518 against 536; at 256 rows the tensor-core kernel wins.
_DEQUANTIZE_MIN_M = 512
# K is split while the output tiles alone number fewer than half the SMs, as long as each split
# keeps at least _MIN_SPLIT_K columns.
_MIN_SPLIT_K = 512
_MAX_SPLIT_K = 8
# tl.dot needs every dim to be at least 16.
_MIN_DOT = 16
# K-tile cap when the scale is constant along K.
_UNCAPPED = 1 << 30

# normed_gemv: one tile of the weight spans the row (4 rows x 2048 columns over 8 warps: 32 values a thread).
NORMED_MAX_K = 2048
_NORMED_BLOCK_N = 4
_NORMED_NUM_WARPS = 8
# normed_gated_gemv: the gated GEMV's tiles (`_gated_gemv_config`: 8 gate and 8 up rows of 256
# columns, 2 warps, K in a loop), with the norm taken out of the product (`_normed_gated_gemv_kernel`).
_NORMED_GATED_BLOCK_N = 8
_NORMED_GATED_BLOCK_K = 256
_NORMED_GATED_NUM_WARPS = 2
# Its programs resident on an SM at once: the JIT compiles it to 167 registers a thread on an H200
# (Triton 3.6.0), so 6 programs of 64 threads fit an SM's 64K registers. It beats the norm's kernel
# and `gated_gemv` only where its grid is one wave of those (Qwen3-1.7B's 768 programs, +2.7%); the
# second, mostly idle wave of Gemma 3 1B's and Llama 3.2 1B's made their steps slower
# (docs/benchmarks/generation.md#pre-norm-inside-the-next-gemv).
_NORMED_GATED_PROGRAMS_PER_SM = 6


def _k_tile_cap(K: int, block_k: int) -> int:
    """The largest K tile that never straddles two scale blocks (a power of two dividing bk)."""
    if block_k >= K:
        return _UNCAPPED
    return block_k & -block_k


def _split_k(tiles: int, K: int, block_k: int, num_sms: int, min_splits: int = 1) -> tuple[int, int]:
    """(splits, columns per split): at least `min_splits`, and more while the output tiles alone
    would leave most SMs idle, as long as each split keeps _MIN_SPLIT_K columns."""
    splits = min_splits
    while (
        splits < _MAX_SPLIT_K
        and tiles * splits < num_sms // 2
        and K // (2 * splits) >= max(_MIN_SPLIT_K, block_k)
    ):
        splits *= 2
    k_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def _k_split(
    kernel: str, config: dict, tiles: int, M: int, K: int, split_k: int | None, device
) -> tuple[int, int]:
    """(splits, columns per split) of the 8-bit and dense kernels over `tiles` output tiles: K /
    `split_k` in whole tiles where given, else `_split_k`. The GEMV splits in whole unrolled steps,
    so that each split streams as many bytes per step, and at least its config's MIN_SPLITS
    (taken out of `config`); the tensor-core kernel keeps decode batches to at most ~4096
    columns per program (deep layers such as down_proj)."""
    block_k = config["BLOCK_K"]
    if kernel == "gemv":
        split_unit = block_k * config.get("UNROLL", 1)
        min_splits = config.pop("MIN_SPLITS", 1)
    else:
        split_unit = block_k
        min_splits = triton.cdiv(K, 4096) if M <= 64 else 1
    if split_k is None:
        return _split_k(tiles, K, split_unit, num_sms(device), min(min_splits, _MAX_SPLIT_K))
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def _gemv_config(M: int, N: int, K: int, k_cap: int, scale_rows: int) -> dict:
    """From sweeps on an H100 (Qwen3-8B and Llama-3.2-3B projections, M = 1, streamed from a CUDA
    graph over distinct weights). Per-channel scales: 16 rows x 512 columns with 8 warps for wide
    layers, 8 x 1024 with 4 warps for narrow and deep ones (more bytes in flight per program where
    there are fewer programs). Block scales of 8 rows or more (fp8's 128 x 128): 8 x 1024 with 4
    warps, the tile across 128-column blocks (x's columns take their own block's scale), which
    read Qwen3-8B's four fp8 projections in 88.5 µs against 109.6 for 128-column tiles; each
    thread folds its 16 adjacent products (FOLD), which took q|k|v from 13.6 to 11.9 µs and
    gate|up from 41.9 to 37.8 (o and down unchanged). Folding made int8's decode slower.
    Scales per 128 columns of each row: tiles of 16 x 128 with the loop unrolled 4 times and 8
    warps, except deep layers (K >= 8192, down_proj): 32 x 128 tiles with 4 warps and K split 8
    ways. docs/benchmarks/quantization.md#gpu-decisions-what-chose-them."""
    if k_cap < 512 and scale_rows % 8 == 0:
        block_k = min(1024, max(triton.next_power_of_2(K), 16))
        # Deep layers split K in two: fp8 down_proj 19.6 -> 17.9 µs on an H200 (quantization.md).
        min_splits = 2 if K >= 8192 else 1
        return dict(
            BLOCK_N=8, BLOCK_K=block_k, UNROLL=1, num_warps=4, num_stages=1, FOLD=16, MIN_SPLITS=min_splits
        )
    if k_cap < 512:
        block_k = min(k_cap, max(triton.next_power_of_2(K), 16))
        if K >= 8192:
            return dict(BLOCK_N=32, BLOCK_K=block_k, UNROLL=1, num_warps=4, num_stages=1, MIN_SPLITS=8)
        unroll = max(1, 512 // block_k)
        return dict(BLOCK_N=16, BLOCK_K=block_k, UNROLL=unroll, num_warps=8, num_stages=1)
    if N >= 5120 and K < 8192:
        block_n, block_k, num_warps = 16, 512, 8
    else:
        block_n, block_k, num_warps = 8, 1024, 4
    block_k = min(block_k, k_cap, max(triton.next_power_of_2(K), 16))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=1, num_warps=num_warps, num_stages=1)


def _dense_gemv_config(N: int, K: int) -> dict:
    """From sweeps of the bf16 projections of Llama-3.2-1B, Qwen3-1.7B and Gemma-3-1B (M = 1,
    streamed from a CUDA graph over distinct weights; docs/benchmarks/generation.md#one-row-gemv):
    - wide gate|up projections: 8 rows x 256 columns with 2 warps (H100; the best tile there
      varied from shape to shape within 3%);
    - K <= 2048 (q|k|v, o): 4 rows and all of K in one tile, 8 warps. The GEMV loads its first
      tile before its PDL wait, so the whole weight's load then overlaps the kernels before;
      gemma's q|k|v (K = 1152) took 1.95 µs under PDL on an H200 against 2.55 for two
      1024-column tiles;
    - deeper rows (down_proj): 4 x 1024 with 8 warps, unless that leaves fewer than 512 tiles
      (about 4 an SM): then 2 x 2048, the same bytes a tile over twice the programs (gemma's down,
      1152 rows: 5.95 µs against 6.65 on an H200; Qwen's and Llama's 2048 rows: 4 x 1024 was
      the fastest)."""
    if N >= 8192:
        block_n, block_k, num_warps = 8, 256, 2
    elif K <= 2048:
        block_n, block_k, num_warps = 4, 2048, 8
    elif triton.cdiv(N, 4) < 512:
        block_n, block_k, num_warps = 2, 2048, 8
    else:
        block_n, block_k, num_warps = 4, 1024, 8
    # A grid's second dimension holds at most 65535 programs (an LM head of 2^19 rows would
    # need more at 8 rows a tile).
    block_n = max(block_n, triton.next_power_of_2(triton.cdiv(N, 65535)))
    block_k = min(block_k, max(triton.next_power_of_2(K), 16))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=1, num_warps=num_warps, num_stages=1)


def _gated_gemv_config(N: int, K: int) -> dict:
    """The gated GEMV's tiles: `_dense_gemv_config` of the whole `[2N, K]` weight, as many gate
    rows a tile as the plain GEMV's rows (and as many up rows again). On an H100, halving the
    tile's rows instead, so that a program streams as many bytes as the plain GEMV's, was slower
    on all three 1-2B gate/up shapes (kernels-bench/bench_gated_gemv.py)."""
    return _dense_gemv_config(N, K)


def _dot_config(M: int, N: int, K: int, k_cap: int) -> dict:
    """Decode batches (M <= 64): thin tiles (32 weight rows) streamed 256 columns at a time, as
    a sweep on an H100 found for M = 2..16. Prefill: 128 x 128 tiles (x 256 tokens from M =
    1024), 64 columns deep, 128 with block scales below M = 1024 (5-12% faster there)."""
    if M <= 64:
        block_m = max(_MIN_DOT, triton.next_power_of_2(M))
        block_k = min(256, k_cap)
        return dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=block_k, GROUP_N=8, num_warps=4, num_stages=4)
    block_m = 256 if M >= 1024 else 128
    block_k = min(128 if k_cap < _UNCAPPED and M < 1024 else 64, k_cap)
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=block_k, GROUP_N=8, num_warps=8, num_stages=3)


# The 4-bit kernels take the 8-bit thresholds above (`_GEMV_MAX_M`, `_DEQUANTIZE_MIN_M`, measured
# for int8 and fp8 on an H100) until the 4-bit ones are measured, and the tiles below.


def _int4_gemv_config(N: int, K: int, k_cap: int, gated: bool = False) -> dict:
    """Groups of 128, K a multiple of 256: wide layers (N >= 6144: Qwen3-8B's q|k|v and gate|up)
    in tiles of 64 rows x 256 columns (two whole groups) with 4 warps, narrower ones (its o and
    down) 256 x 128 with 8 warps, each tile loading the next one before it sums its own (PREFETCH
    1); the gated GEMV (`gated`: N its gate rows, K unsplit) 32 x 256 with 4 warps, nothing
    ahead. On an H200, Qwen3-8B's four projections took 57.8 µs against 69.1 with 128 x 128
    tiles, 8 warps, nothing ahead (the best of 13-25 tiles and choices a shape), and W1 decoded
    371.3 and 371.0 tok/s against 322.9 and 322.8; the gated GEMV then took it to 387.6 and 387.6
    against 372.6 and 372.1 (docs/benchmarks/quantization.md#a-tile-loaded-ahead). Other K: 128 x
    128 with 8 warps, nothing ahead. Other groups (not measured): tiles of 8192 weights inside one
    group with 4 warps, the loop unrolled to 512 columns a step. K split by `_int4_gemv_splits`."""
    block_k = min(k_cap, 256)
    if block_k == 128 and K % 256 == 0 and gated:
        block_k, block_n, unroll, warps, prefetch = 256, 32, 1, 4, 0
    elif block_k == 128 and K % 256 == 0 and N >= 6144:
        block_k, block_n, unroll, warps, prefetch = 256, 64, 1, 4, 1
    elif block_k == 128 and K % 256 == 0:
        block_n, unroll, warps, prefetch = 256, 1, 8, 1
    elif block_k == 128:
        block_n, unroll, warps, prefetch = 128, 1, 8, 0
    else:
        block_n, unroll, warps, prefetch = max(16, min(256, 8192 // block_k)), max(1, 512 // block_k), 4, 0
    # A grid's second dimension holds at most 65535 programs (an LM head of 2^22 rows).
    block_n = max(block_n, triton.next_power_of_2(triton.cdiv(N, 65535)))
    return dict(
        BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll, num_warps=warps, num_stages=1, PREFETCH=prefetch
    )


def _int4_gemv_splits(tiles: int, K: int, split_unit: int, num_sms: int) -> int:
    """K splits for the GEMV: doubled while the programs number fewer than two a SM (its tiles are
    twice the 8-bit GEMV's bytes, so fewer programs cover a weight), each split keeping a whole
    unrolled step. Not yet measured: the 8-bit rule (quantized_linear._split_k) stops at half
    the SMs."""
    splits = 1
    while splits < _MAX_SPLIT_K and tiles * splits < 2 * num_sms and K // (2 * splits) >= split_unit:
        splits *= 2
    return splits


# gemv.int4_mma (int4_linear's kernel="mma"): 4 warps a program, the K split (up to 16 ways) while
# the programs number fewer than 4 an SM; 64 weight rows a program, 128 where the outputs number
# at most _INT4_MMA_WIDE_MAX_N (Qwen3-8B's o and down: 32 tiles in 16 splits, under PDL 1.2-1.4x
# faster than 64 rows in 8 on an H200; qkv and gate_up are fastest at 64 rows). kernels-bench/
# sweep_int4_mma.py; docs/benchmarks/quantization.md#the-one-row-gemv-on-tensor-cores-in-gluon.
_INT4_MMA_BLOCK_N = 64
_INT4_MMA_WIDE_BLOCK_N = 128
_INT4_MMA_WIDE_MAX_N = 4096
_INT4_MMA_WARPS = 4
_INT4_MMA_PROGRAMS_PER_SM = 4
_INT4_MMA_MAX_SPLITS = 16


def _int4_mma_config(outputs: int) -> dict:
    """gemv.int4_mma's rows (BLOCK_N: a gated tile's halves are gate and up) and warps a
    program, for a product of `outputs` rows (the gated one's N // 2)."""
    wide = outputs <= _INT4_MMA_WIDE_MAX_N
    return {"BLOCK_N": _INT4_MMA_WIDE_BLOCK_N if wide else _INT4_MMA_BLOCK_N, "WARPS": _INT4_MMA_WARPS}


def _int4_mma_splits(tiles: int, groups_a_row: int, groups_a_step: int, num_sms: int) -> int:
    """K splits for gemv.int4_mma: doubled while the programs number fewer than
    _INT4_MMA_PROGRAMS_PER_SM an SM, each split whole steps of `groups_a_step` groups."""
    splits = 1
    while (
        splits < _INT4_MMA_MAX_SPLITS
        and tiles * splits < _INT4_MMA_PROGRAMS_PER_SM * num_sms
        and groups_a_row % (2 * splits * groups_a_step) == 0
    ):
        splits *= 2
    return splits


def _int4_dot_config(M: int, k_cap: int) -> dict:
    """quantized_linear._dot_config's tiles (not yet swept for 4 bits) but for decode batches (M
    <= 64) 64 weight rows a tile where 8 bits take 32: in the SASS for sm_90 (Triton 3.9, groups
    of 128, 16 rows of x, 4 warps) a 32 x 128 weight tile's loop body is 249 instructions a
    thread for its 32 weights, a 64 x 128 one's 351 for 64, a 128 x 128 one's 581 for 128 (the
    dequantized tile goes to the MMA's operand layout through shared memory). More rows of x:
    128 x 128 tiles, 128 columns deep."""
    if M <= 64:
        block_m = max(_MIN_DOT, triton.next_power_of_2(M))
        return dict(
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=min(256, k_cap), GROUP_N=8, num_warps=4, num_stages=4
        )
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=min(128, k_cap), GROUP_N=8, num_warps=8, num_stages=3)


def _int4_k_per_split(
    kernel: str, config: dict, tiles: int, M: int, K: int, split_k: int | None, device
) -> int:
    """Columns a program of `tiles` output tiles reads: K / `split_k` in whole tiles where given,
    else the GEMV's `_int4_gemv_splits` in whole unrolled steps, or the tensor-core kernel's 8-bit rule."""
    block_k = config["BLOCK_K"]
    if split_k is not None:
        return triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    if kernel == "gemv":
        unit = block_k * config["UNROLL"]  # whole unrolled steps: as many bytes a split
        return triton.cdiv(triton.cdiv(K, _int4_gemv_splits(tiles, K, unit, num_sms(device))), unit) * unit
    # Decode batches: at most ~4096 columns a program (deep layers such as down_proj).
    min_splits = min(triton.cdiv(K, 4096) if M <= 64 else 1, _MAX_SPLIT_K)
    return _split_k(tiles, K, block_k, num_sms(device), min_splits)[1]
