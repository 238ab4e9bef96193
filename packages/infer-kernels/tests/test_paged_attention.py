"""paged_attention: the reference against a per-query, per-head loop in float64 straight from the
definition, and the Triton kernels (decode and extend) against the reference."""

import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import (
    TOLERANCES,
    assert_close,
    native_cpu_kernels_available,
    paged_attention,
    paged_attention_cpu,
    paged_attention_ref,
)

# The modules (infer.kernels exports a function under the package's name).
decode_module = importlib.import_module("infer.kernels.paged_attention.decode")
extend_module = importlib.import_module("infer.kernels.paged_attention.extend")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (q heads, kv heads, head_dim): GQA groups 1, 2 and 4, a head_dim that is not a power of two,
# and Gemma 3 1B's one KV head of 256.
HEAD_SHAPES = [(2, 2, 64), (4, 2, 64), (4, 1, 64), (4, 2, 80), (2, 1, 256)]
# block_size None: the contiguous pool, one block of max_seq_len per row.
BLOCK_SIZES = [1, 3, 16, None]
# Decode rows' key counts, then extend rows' (query_len, seq_len): with a prefix and without.
MIXED = dict(decode=[5, 1, 40], extend=[(7, 19), (9, 9), (1, 30)])


def make_batch(decode, extend, heads, block_size, dtype, device, seed):
    """q, k_cache, v_cache and paged_attention's keyword arguments for rows of `decode` key
    counts (one query each) followed by rows of `extend` (query_len, seq_len). Each row's blocks
    are distinct ids in random order; table entries past a row's blocks are random valid ids."""
    num_q_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    rows = [(1, seq_len) for seq_len in decode] + list(extend)
    max_seq_len = max(seq_len for _, seq_len in rows)
    block_size = block_size or max_seq_len
    blocks_per_row = [math.ceil(seq_len / block_size) for _, seq_len in rows]
    num_blocks = sum(blocks_per_row) + 2
    max_blocks = math.ceil(max_seq_len / block_size) + 1
    block_tables = torch.randint(0, num_blocks, (len(rows), max_blocks), generator=gen, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=gen).int()
    taken = 0
    for b, count in enumerate(blocks_per_row):
        block_tables[b, :count] = order[taken : taken + count]
        taken += count
    query_lens = [query_len for query_len, _ in rows]
    num_tokens = sum(query_lens)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(device, dtype)
    k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    kwargs = dict(
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(device, torch.int32),
        seq_lens=torch.tensor([seq_len for _, seq_len in rows], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        num_decode_rows=len(decode),
        max_query_len=max(query_lens),
        max_seq_len=max_seq_len,
        scale=1 / math.sqrt(head_dim),
    )
    return q, k_cache, v_cache, kwargs


def brute_force(q, k_cache, v_cache, *, query_start_loc, seq_lens, block_tables, scale, sliding_window, **_):
    """Query by query, head by head, key by key, in float64 on the CPU."""
    q, k_cache, v_cache, block_tables = q.cpu(), k_cache.cpu(), v_cache.cpu(), block_tables.cpu()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    flat_k = k_cache.reshape(-1, num_kv_heads, k_cache.shape[3]).double()
    flat_v = v_cache.reshape(-1, num_kv_heads, v_cache.shape[3]).double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    bounds = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        query_len = bounds[b + 1] - bounds[b]
        for i in range(query_len):
            position = seq_len - query_len + i
            keys = [
                j
                for j in range(seq_len)
                if j <= position and (not sliding_window or j > position - sliding_window)
            ]
            slots = [int(block_tables[b, j // block_size]) * block_size + j % block_size for j in keys]
            for h in range(q.shape[1]):
                k = flat_k[slots, h // group]
                v = flat_v[slots, h // group]
                weights = torch.softmax(k @ q[bounds[b] + i, h].double() * scale, dim=0)
                out[bounds[b] + i, h] = weights @ v
    return out


# --- the reference against the definition --------------------------------------------------------


@pytest.mark.parametrize("heads", HEAD_SHAPES[:4])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("sliding_window", [None, 4, 1000])
def test_reference_equals_the_brute_force_loop(heads, block_size, sliding_window):
    q, k_cache, v_cache, kwargs = make_batch(
        MIXED["decode"], MIXED["extend"], heads, block_size, torch.float32, "cpu", 1
    )
    out = paged_attention_ref(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)
    expected = brute_force(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "decode, extend",
    [([], [(5, 12), (3, 3)]), ([7, 2, 33], []), ([4], [(6, 6)])],
    ids=["no-decode-rows", "no-extend-rows", "one-of-each"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_the_brute_force_loop_on_one_sided_batches(decode, extend, dtype):
    q, k_cache, v_cache, kwargs = make_batch(decode, extend, (4, 2, 64), 3, dtype, "cpu", seed=2)
    out = paged_attention_ref(q, k_cache, v_cache, sliding_window=5, **kwargs)
    assert out.dtype == dtype and out.shape == q.shape
    expected = brute_force(q, k_cache, v_cache, sliding_window=5, **kwargs)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected.to(dtype), atol=tolerance.atol, rtol=tolerance.rtol)


def test_reference_writes_into_out():
    q, k_cache, v_cache, kwargs = make_batch(
        MIXED["decode"], MIXED["extend"], (4, 2, 64), 16, torch.float32, "cpu", 3
    )
    out = torch.full_like(q, float("nan"))
    assert paged_attention(q, k_cache, v_cache, out=out, **kwargs) is out
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, **kwargs))


# --- the CPU path against the reference ----------------------------------------------------------


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("sliding_window", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False], ids=["native", "sdpa"])
def test_cpu_path_equals_the_reference(heads, block_size, sliding_window, dtype, native):
    """fp32 decode rows take decode_attention_cpu.c with `native=True` (the default), SDPA with
    `native=False`; bf16 ones take SDPA either way."""
    q, k_cache, v_cache, kwargs = make_batch(
        MIXED["decode"], MIXED["extend"], heads, block_size, dtype, "cpu", 4
    )
    out = paged_attention_cpu(q, k_cache, v_cache, sliding_window=sliding_window, native=native, **kwargs)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs))


@pytest.mark.skipif(not native_cpu_kernels_available(), reason="infer.kernels' C kernels are not built here")
@pytest.mark.parametrize("sliding_window", [None, 300])
def test_the_native_decode_path_at_a_thousand_keys(sliding_window):
    """Long rows against the float64 definition: softmax's exponentials in vectors of eight, and
    a window that starts mid-block."""
    q, k_cache, v_cache, kwargs = make_batch([1000, 999, 8], [], (9, 3, 64), 16, torch.float32, "cpu", 8)
    q *= 4  # sharper softmaxes than randn's
    out = paged_attention_cpu(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)
    expected = brute_force(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    sdpa = paged_attention_cpu(q, k_cache, v_cache, sliding_window=sliding_window, native=False, **kwargs)
    assert not torch.equal(out, sdpa)  # a different sum order: the C kernel ran


@pytest.mark.skipif(not native_cpu_kernels_available(), reason="infer.kernels' C kernels are not built here")
def test_the_native_decode_path_gives_nan_for_a_head_whose_query_is_nan():
    q, k_cache, v_cache, kwargs = make_batch([20, 20], [], (4, 2, 64), 16, torch.float32, "cpu", 9)
    q[1, 2, 5] = float("nan")
    out = paged_attention_cpu(q, k_cache, v_cache, **kwargs)
    assert out[1, 2].isnan().all()
    assert not out[1, [0, 1, 3]].isnan().any() and not out[0].isnan().any()


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_cpu_path_reads_the_decode_key_slots_it_is_given(sliding_window):
    """The slots made once per step stand for the block table on the SDPA path: the result is the
    reference's for the table they were made from (here a shuffled one), whatever table is passed.
    (The C kernel reads the table itself, and the slots made from it are the same keys.)"""
    q, k_cache, v_cache, kwargs = make_batch(
        MIXED["decode"], MIXED["extend"], (4, 2, 64), 3, torch.float32, "cpu", 6
    )
    block_size = k_cache.shape[1]
    shuffled = dict(
        kwargs, block_tables=kwargs["block_tables"][:, torch.randperm(kwargs["block_tables"].shape[1])]
    )
    slots = []
    for b, seq_len in enumerate(kwargs["seq_lens"][: kwargs["num_decode_rows"]].tolist()):
        positions = torch.arange(seq_len)
        slots.append(
            shuffled["block_tables"][b, positions // block_size].long() * block_size + positions % block_size
        )
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        sliding_window=sliding_window,
        decode_key_slots=tuple(slots),
        native=False,
        **kwargs,
    )
    decode = slice(0, kwargs["num_decode_rows"])
    expected = paged_attention_ref(q, k_cache, v_cache, sliding_window=sliding_window, **shuffled)
    assert_close(out[decode], expected[decode])
    assert not torch.allclose(
        out[decode], paged_attention_ref(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)[decode]
    )


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_cpu_path_reads_consecutive_slots_given_as_a_range(sliding_window):
    """A decode row whose blocks are consecutive may give its slots as a range (read as a view of
    the cache): the result is the reference's for that block table."""
    q, k_cache, v_cache, kwargs = make_batch(
        MIXED["decode"], MIXED["extend"], (4, 2, 64), 3, torch.float32, "cpu", 7
    )
    block_size = k_cache.shape[1]
    block_tables = kwargs["block_tables"].clone()
    slots, first_block = [], 1
    for b, seq_len in enumerate(kwargs["seq_lens"][: kwargs["num_decode_rows"]].tolist()):
        count = math.ceil(seq_len / block_size)
        block_tables[b, :count] = torch.arange(first_block, first_block + count)
        slots.append(range(first_block * block_size, first_block * block_size + seq_len))
        first_block += count
    kwargs = dict(kwargs, block_tables=block_tables)
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        sliding_window=sliding_window,
        decode_key_slots=tuple(slots),
        native=False,
        **kwargs,
    )
    decode = slice(0, kwargs["num_decode_rows"])
    expected = paged_attention_ref(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)
    assert_close(out[decode], expected[decode])


@pytest.mark.parametrize(
    "decode, extend", [([], [(5, 12), (3, 3)]), ([7, 2, 33], [])], ids=["no-decode-rows", "no-extend-rows"]
)
def test_cpu_path_on_one_sided_batches_writes_into_out(decode, extend):
    q, k_cache, v_cache, kwargs = make_batch(decode, extend, (4, 2, 64), 3, torch.float32, "cpu", seed=5)
    out = torch.full_like(q, float("nan"))
    assert paged_attention(q, k_cache, v_cache, out=out, sliding_window=5, **kwargs) is out  # the CPU path
    expected = brute_force(q, k_cache, v_cache, sliding_window=5, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# --- the Triton kernels against the reference ----------------------------------------------------


def check_kernel(decode, extend, heads, block_size, dtype, device, seed, sliding_window=None):
    q, k_cache, v_cache, kwargs = make_batch(decode, extend, heads, block_size, dtype, device, seed)
    out = paged_attention(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs))


@pytest.fixture
def short_splits(monkeypatch):
    """Decode splits of 64 keys and extend tiles of 16 queries x 16 keys, so that tiny
    interpreted rows still span several splits and tiles."""
    monkeypatch.setattr(decode_module, "_MIN_SPLIT_KEYS", 64)
    monkeypatch.setattr(extend_module, "_EXTEND_CONFIG", (16, 16, 4, 1))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_kernel_interpreted_mixed_batch_any_block_size(triton_on_cpu, short_splits, block_size):
    # 70 keys: two tiles of 64, the last ragged; 40-token chunk over a 100-key prefix.
    check_kernel([70, 1, 130], [(40, 140), (17, 17)], (4, 2, 64), block_size, torch.float32, "cpu", seed=4)


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_interpreted_heads_and_dtypes(triton_on_cpu, heads, dtype):
    check_kernel([70, 3], [(5, 80)], heads, 16, dtype, "cpu", seed=5)


@pytest.mark.parametrize("sliding_window", [1, 5, 64, 65, 1000])
def test_kernel_interpreted_sliding_window(triton_on_cpu, short_splits, sliding_window):
    check_kernel([150, 2, 64], [(70, 150), (20, 20)], (4, 1, 64), 16, torch.float32, "cpu", 6, sliding_window)


@pytest.mark.parametrize(
    "decode, extend",
    [([], [(70, 75), (1, 9)]), ([150, 9], [])],
    ids=["no-decode-rows", "no-extend-rows"],
)
def test_kernel_interpreted_one_sided_batches(triton_on_cpu, short_splits, decode, extend):
    check_kernel(decode, extend, (4, 2, 64), 3, torch.bfloat16, "cpu", seed=7, sliding_window=66)


def test_kernel_interpreted_writes_into_out(triton_on_cpu):
    q, k_cache, v_cache, kwargs = make_batch([9], [(3, 5)], (4, 2, 64), 4, torch.float32, "cpu", seed=8)
    out = torch.full_like(q, float("nan"))
    assert paged_attention(q, k_cache, v_cache, out=out, **kwargs) is out
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, **kwargs))


def test_kernel_interpreted_splits_past_a_rows_length_leave_it_alone(triton_on_cpu, short_splits):
    # A graph is captured at the model's longest length: max_seq_len far beyond every row.
    q, k_cache, v_cache, kwargs = make_batch([3, 70], [], (4, 2, 64), 16, torch.float32, "cpu", seed=9)
    kwargs["max_seq_len"] = 300
    block_tables = kwargs["block_tables"]
    kwargs["block_tables"] = torch.cat([block_tables, block_tables[:, :1].expand(-1, 15)], dim=1)
    assert_close(
        paged_attention(q, k_cache, v_cache, **kwargs), paged_attention_ref(q, k_cache, v_cache, **kwargs)
    )


def shuffled_tile_map(kwargs, tile_size, num_slots, seed):
    """The extend rows' (row, tile) pairs in a random order among empty slots (row -1)."""
    bounds = kwargs["query_start_loc"].tolist()
    first_row = kwargs["num_decode_rows"]
    pairs = [
        (row, tile)
        for row in range(first_row, len(bounds) - 1)
        for tile in range(math.ceil((bounds[row + 1] - bounds[row]) / tile_size))
    ]
    pairs += [(-1, 0)] * (num_slots - len(pairs))
    order = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.tensor([pairs[i] for i in order], dtype=torch.int32).T.contiguous()


@pytest.mark.parametrize("sliding_window", [None, 20])
def test_kernel_interpreted_extend_rows_from_a_tile_map(triton_on_cpu, short_splits, sliding_window):
    # A CUDA graph's launch plan: the extend rows' tiles in any order, empty slots between.
    q, k_cache, v_cache, kwargs = make_batch(
        [70, 1], [(40, 140), (17, 17), (1, 9)], (4, 2, 64), 16, torch.float32, "cpu", seed=15
    )
    tile_size = extend_module.extend_tile_size(64)
    assert tile_size == 16  # short_splits' tiles
    tiles = shuffled_tile_map(kwargs, tile_size, num_slots=9, seed=16)  # 3 + 2 + 1 tiles, 3 empty
    out = paged_attention(q, k_cache, v_cache, sliding_window=sliding_window, extend_tiles=tiles, **kwargs)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs))


def test_kernel_interpreted_extend_tokens_no_tile_names_are_left_alone(triton_on_cpu, short_splits):
    q, k_cache, v_cache, kwargs = make_batch([30], [(20, 25)], (4, 2, 64), 16, torch.float32, "cpu", seed=17)
    tiles = torch.tensor([[-1, -1], [0, 0]], dtype=torch.int32)  # two slots, both empty
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, out=out, extend_tiles=tiles, **kwargs)
    assert_close(out[:1], paged_attention_ref(q, k_cache, v_cache, **kwargs)[:1])  # the decode row
    assert out[1:].isnan().all()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    decode=st.lists(st.integers(1, 140), max_size=3),
    extend=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 70)), max_size=2),
    heads=st.sampled_from(HEAD_SHAPES[:4]),
    block_size=st.sampled_from(BLOCK_SIZES),
    sliding_window=st.sampled_from([None, 1, 16, 100]),
    seed=st.integers(0, 2**16),
)
def test_kernel_interpreted_any_batch(
    triton_on_cpu, short_splits, decode, extend, heads, block_size, sliding_window, seed
):
    extend = [(query_len, query_len + prefix) for query_len, prefix in extend]
    if decode or extend:
        check_kernel(decode, extend, heads, block_size, torch.float32, "cpu", seed, sliding_window)


def test_rejects_mismatched_inputs():
    q, k_cache, v_cache, kwargs = make_batch([4], [(2, 6)], (4, 2, 64), 4, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.half(), k_cache, v_cache, **kwargs)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q[..., :32], k_cache, v_cache, **kwargs)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        paged_attention(q[:, :3], k_cache, v_cache, **kwargs)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(q, k_cache.transpose(0, 1), v_cache.transpose(0, 1), **kwargs)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(q, k_cache, v_cache, **{**kwargs, "seq_lens": kwargs["seq_lens"].float()})
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(q, k_cache, v_cache, **{**kwargs, "query_start_loc": kwargs["query_start_loc"][:2]})
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(q, k_cache, v_cache, **{**kwargs, "block_tables": kwargs["block_tables"][:1]})
    with pytest.raises(ValueError, match="max_seq_len"):
        paged_attention(q, k_cache, v_cache, **{**kwargs, "max_seq_len": 1000})
    with pytest.raises(ValueError, match="num_decode_rows"):
        paged_attention(q, k_cache, v_cache, **{**kwargs, "num_decode_rows": 3})
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, k_cache, v_cache, sliding_window=0, **kwargs)
    with pytest.raises(ValueError, match="out"):
        paged_attention(q, k_cache, v_cache, out=q[:1], **kwargs)


def test_decode_splits_fill_the_gpu_from_host_ints():
    # Llama 3.2 1B at batch 64: 8 splits per (row, KV head); at batch 1 and 4096 keys: 16.
    assert decode_module.decode_num_splits(64, 8, 4096) == 8
    assert decode_module.decode_num_splits(1, 8, 4096) == 16
    # Short rows take one split (no merge pass).
    assert decode_module.decode_num_splits(64, 8, 200) == 1


@pytest.mark.parametrize("sliding_window", [None, 100])
def test_kernel_interpreted_rows_far_below_the_launch_bound(triton_on_cpu, sliding_window):
    """A CUDA graph's launch is sized for the model's longest row (here 2048 keys: 8 splits);
    each row cuts its own keys into those splits: 1100 keys into 8 of 3 tiles, the short rows
    into single tiles."""
    q, k_cache, v_cache, kwargs = make_batch(
        [70, 1, 1100, 129], [(5, 80)], (4, 2, 64), 16, torch.float32, "cpu", 6
    )
    tables = kwargs["block_tables"]
    kwargs["block_tables"] = torch.cat([tables, tables[:, :1].expand(-1, 2048 // 16)], dim=1)
    kwargs["max_seq_len"] = 2048
    assert decode_module.decode_num_splits(4, 2, 2048) == 8
    out = paged_attention(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs))


# --- CUDA: realistic shapes, and a CUDA graph replayed with new lengths and block tables ----------


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8, 64), (16, 8, 128), (4, 1, 256), (9, 3, 64), (4, 2, 80)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sliding_window", [None, 512])
@pytest.mark.parametrize("block_size", [16, None])
def test_kernel_cuda_mixed_batch(cuda, heads, dtype, sliding_window, block_size):
    decode = [1500, 1, 700, 257, 1024, 33]
    extend = [(300, 1500), (1000, 1000), (1, 64)]
    check_kernel(decode, extend, heads, block_size, dtype, cuda, seed=10, sliding_window=sliding_window)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_cuda_llama_1b_batch_64_at_4096_keys(cuda, dtype):
    check_kernel([4096] * 64, [], (32, 8, 64), 16, dtype, cuda, seed=11)
    check_kernel([], [(512, 2560)] * 4, (32, 8, 64), 16, dtype, cuda, seed=12)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, None])
@pytest.mark.parametrize("heads", [(32, 8, 64), (4, 1, 256)])
@pytest.mark.parametrize("pdl", [False, True])
def test_kernel_in_a_cuda_graph_follows_new_lengths_and_block_tables(cuda, block_size, heads, pdl):
    """Under PDL each split reads its row's length, block table and first keys before waiting
    for the kernel before: replays with new lengths, tables and queries must see the new ones."""
    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0 or newer")
    max_len = 1024  # captured at the model's longest length; rows are shorter: 4 splits
    decode = [max_len, 5, 600, 300, 129, 1000, 64, 17]
    q, k_cache, v_cache, kwargs = make_batch(decode, [], heads, block_size, torch.bfloat16, cuda, 13)
    paged_attention(q, k_cache, v_cache, pdl=pdl, **kwargs)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, k_cache, v_cache, pdl=pdl, **kwargs)
    gen = torch.Generator().manual_seed(14)
    for _ in range(3):
        new_lens = torch.randint(1, max_len + 1, (len(decode),), generator=gen, dtype=torch.int32)
        kwargs["seq_lens"].copy_(new_lens)
        num_blocks = k_cache.shape[0]
        kwargs["block_tables"].copy_(
            torch.randint(0, num_blocks, kwargs["block_tables"].shape, generator=gen)
        )
        q.copy_(torch.randn(q.shape, generator=gen))
        graph.replay()
        assert_close(out, paged_attention_ref(q, k_cache, v_cache, **kwargs))


@pytest.mark.gpu
def test_kernel_in_a_cuda_graph_follows_new_prompt_chunks_through_a_tile_map(cuda):
    """One capture, replayed for other chunk lengths, rows and block tables: the grid is the
    map's length, and the map, lengths and tables are read on the device."""
    heads, max_len = (32, 8, 64), 1024
    tile_size = extend_module.extend_tile_size(heads[2])
    decode, num_chunk_tokens, num_extend_rows = [700, 5, 300], 512, 4
    # Capture-time rows: the chunk tokens split evenly; replays split them otherwise.
    extend = [(num_chunk_tokens // num_extend_rows, max_len)] * num_extend_rows
    q, k_cache, v_cache, kwargs = make_batch(decode, extend, heads, 16, torch.bfloat16, cuda, 18)
    kwargs.update(max_query_len=num_chunk_tokens, max_seq_len=max_len)
    num_slots = num_chunk_tokens // tile_size + num_extend_rows
    tiles = shuffled_tile_map(kwargs, tile_size, num_slots, seed=19).to(cuda)
    paged_attention(q, k_cache, v_cache, extend_tiles=tiles, **kwargs)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, k_cache, v_cache, extend_tiles=tiles, **kwargs)
    gen = torch.Generator().manual_seed(20)
    for chunks in ([(500, 900), (1, 1), (11, 11)], [(256, 256), (256, 1024)], [(3, 700)]):
        # Unused extend rows get no tokens; their tokens follow the last real row's as padding.
        chunks = chunks + [(0, 0)] * (num_extend_rows - len(chunks))
        query_lens = [1] * len(decode) + [query_len for query_len, _ in chunks]
        starts = torch.tensor([0, *query_lens]).cumsum(0)
        kwargs["query_start_loc"].copy_(starts.clamp(max=q.shape[0]))
        new_lens = torch.randint(1, max_len + 1, (len(decode),), generator=gen).tolist()
        kwargs["seq_lens"].copy_(torch.tensor(new_lens + [seq_len for _, seq_len in chunks]))
        kwargs["block_tables"].copy_(
            torch.randint(0, k_cache.shape[0], kwargs["block_tables"].shape, generator=gen)
        )
        tiles.copy_(shuffled_tile_map(kwargs, tile_size, num_slots, seed=len(chunks)))
        q.copy_(torch.randn(q.shape, generator=gen))
        graph.replay()
        used = int(starts[-1])
        assert_close(out[:used], paged_attention_ref(q, k_cache, v_cache, **kwargs)[:used])


@pytest.mark.parametrize(
    "num_kv_heads, max_seq_len", [(8, 1024), (8, 131072), (1, 4096), (32, 2048), (4, 300)]
)
def test_the_warm_up_lengths_launch_every_merge_variant_a_decode_step_may(num_kv_heads, max_seq_len):
    """Brute force over every decode step shape (rows, longest row) against the variants the
    one-row warm-up lengths launch: (SPLITS_PAD, num_splits a multiple of 16)."""
    from infer.kernels.paged_attention import decode_num_splits, decode_warm_up_lengths

    def variant(num_splits: int) -> tuple[int, bool]:
        return 1 << (num_splits - 1).bit_length(), num_splits % 16 == 0

    lengths = decode_warm_up_lengths(num_kv_heads, max_seq_len)
    assert all(1 <= length <= max_seq_len for length in lengths)
    warmed = {variant(decode_num_splits(1, num_kv_heads, length)) for length in lengths}
    needed = {
        variant(num_splits)
        for rows in (*range(1, 65), 128, 256)
        for length in (*range(1, max_seq_len + 1, 61 if max_seq_len > 5000 else 1), max_seq_len)
        if (num_splits := decode_num_splits(rows, num_kv_heads, length)) > 1
    }
    assert needed <= warmed
    assert len(lengths) == len(warmed)  # one length a variant
