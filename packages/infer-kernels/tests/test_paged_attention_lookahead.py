"""paged_attention's `lookahead` (an image's tokens attend to each other both ways, Gemma 3's vision
tokens) against an oracle that knows nothing of lookahead: each row's whole sequence gathered
densely, a mask built key by key from the row's image groups, and torch's SDPA in float64.

The batches are test_paged_attention's, with images laid over the extend rows. Under
`short_splits` the extend kernel's tiles are 16 queries x 16 keys, so short rows put images
across tile boundaries."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from infer.kernels import TOLERANCES, paged_attention, paged_attention_ref

from .test_paged_attention import make_batch, short_splits, shuffled_tile_map  # noqa: F401

extend_module = importlib.import_module("infer.kernels.paged_attention.extend")

# (decode rows' key counts, extend rows as (query_len, seq_len, images)), an image being (first
# position, length). Queries of a row sit at positions seq_len - query_len .. seq_len - 1.
CASES = {
    "no-image": ([], [(20, 20, [])]),
    # Positions 10..39 queried; the image at 15..24.
    "one-image": ([], [(30, 40, [(15, 10)])]),
    "two-images": ([], [(40, 40, [(3, 7), (20, 14)])]),
    # 20 tokens over query tiles 0..15 and 16..31: tile 0's queries see keys of tile 1.
    "image-longer-than-a-tile": ([], [(40, 40, [(4, 20)])]),
    # From query 10 of tile 0 to query 21 of tile 1.
    "image-from-mid-tile-into-the-next": ([], [(32, 32, [(10, 12)])]),
    # Positions 20..49 queried: the image's first 8 tokens (12..19) are cached keys.
    "chunk-starts-mid-image": ([], [(30, 50, [(12, 16)])]),
    # The whole row one image: its first query sees every key.
    "row-is-one-image": ([], [(17, 17, [(0, 17)])]),
    "decode-rows-first": ([33, 1, 70], [(24, 30, [(8, 9)]), (17, 17, [(0, 17)])]),
}
# Every kind above in one batch.
MIXED = ([33, 1, 70], [(20, 20, []), (30, 50, [(12, 16)]), (40, 45, [(9, 20), (30, 12)]), (1, 9, [])])
# None, and a window longer than every image (the caller's promise) that still cuts the rows.
WINDOWS = [None, 24]


def image_batch(decode, extend, heads, block_size, dtype, device, seed):
    """make_batch's batch for `decode` and `extend` (CASES' rows) with the queries' `lookahead`
    among its arguments, and each row's image groups: a group id per position, -1 for text."""
    q, k_cache, v_cache, kwargs = make_batch(
        decode,
        [(query_len, seq_len) for query_len, seq_len, _ in extend],
        heads,
        block_size,
        dtype,
        device,
        seed,
    )
    groups = [[-1] * seq_len for seq_len in decode]
    lookahead = [0] * len(decode)
    for query_len, seq_len, images in extend:
        row_groups = [-1] * seq_len
        for group, (first, length) in enumerate(images):
            row_groups[first : first + length] = [group] * length
        groups.append(row_groups)
        for position in range(seq_len - query_len, seq_len):
            group = row_groups[position]
            last = max(j for j in range(seq_len) if row_groups[j] == group) if group >= 0 else position
            lookahead.append(last - position)
    kwargs["lookahead"] = torch.tensor(lookahead, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, kwargs, groups


def sdpa_over_image_groups(
    q, k_cache, v_cache, groups, *, query_start_loc, seq_lens, block_tables, scale, sliding_window, **_
):
    """Row by row in float64 on the CPU: key k is visible to the query at position p if
    k <= p and within the window, or if both are tokens of the same image (one group >= 0)."""
    q, k_cache, v_cache, block_tables = q.cpu(), k_cache.cpu(), v_cache.cpu(), block_tables.cpu()
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim).double()
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim).double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    bounds = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        slots = [int(block_tables[b, j // block_size]) * block_size + j % block_size for j in range(seq_len)]
        keys_at = torch.arange(seq_len)[None, :]
        positions = torch.arange(seq_len - (end - start), seq_len)[:, None]
        row_groups = torch.tensor(groups[b])
        query_groups = row_groups[positions]
        mask = (keys_at <= positions) & (keys_at > positions - (sliding_window or seq_len))
        mask |= (query_groups >= 0) & (row_groups[keys_at] == query_groups)  # [L, S]
        rows = F.scaled_dot_product_attention(
            q[start:end].double().transpose(0, 1)[None],  # [1, Hq, L, D]
            flat_k[slots].transpose(0, 1)[None],  # [1, Hkv, S, D]
            flat_v[slots].transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = rows[0].transpose(0, 1)
    return out


def assert_close_to_oracle(out, expected):
    tolerance = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.cpu(), expected.to(out.dtype), atol=tolerance.atol, rtol=tolerance.rtol)


def check_images(case, heads, block_size, dtype, device, seed, sliding_window, attend=paged_attention):
    q, k_cache, v_cache, kwargs, groups = image_batch(*case, heads, block_size, dtype, device, seed)
    out = attend(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_to_oracle(
        out, sdpa_over_image_groups(q, k_cache, v_cache, groups, sliding_window=sliding_window, **kwargs)
    )


# --- the reference and the CPU path ----------------------------------------------------------------


@pytest.mark.parametrize("attend", [paged_attention, paged_attention_ref], ids=["cpu-path", "reference"])
@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cpu_path_and_reference_follow_image_groups(case, sliding_window, attend):
    check_images(case, (4, 2, 64), 3, torch.float32, "cpu", 1, sliding_window, attend)


@pytest.mark.parametrize("heads", [(2, 2, 64), (4, 2, 64), (4, 1, 64)])
@pytest.mark.parametrize("block_size", [1, 16, None])
def test_cpu_path_follows_image_groups_any_heads_and_block_size(heads, block_size):
    check_images(MIXED, heads, block_size, torch.float32, "cpu", 2, 24)


# --- the Triton kernel, interpreted ----------------------------------------------------------------


@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.usefixtures("triton_on_cpu", "short_splits")
def test_kernel_interpreted_follows_image_groups(case, sliding_window):
    check_images(case, (4, 2, 64), 3, torch.float32, "cpu", 3, sliding_window)


@pytest.mark.parametrize("heads", [(2, 2, 64), (4, 2, 64), (4, 1, 64)])
@pytest.mark.parametrize("block_size", [1, 16, None])
@pytest.mark.usefixtures("triton_on_cpu", "short_splits")
def test_kernel_interpreted_follows_image_groups_any_heads_and_block_size(heads, block_size):
    check_images(MIXED, heads, block_size, torch.float32, "cpu", 4, 24)


@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.usefixtures("triton_on_cpu", "short_splits")
def test_kernel_interpreted_follows_image_groups_through_a_tile_map(sliding_window):
    q, k_cache, v_cache, kwargs, groups = image_batch(*MIXED, (4, 2, 64), 3, torch.float32, "cpu", seed=5)
    tile_size = extend_module.extend_tile_size(64)
    assert tile_size == 16  # short_splits' tiles
    tiles = shuffled_tile_map(kwargs, tile_size, num_slots=10, seed=6)  # 2 + 2 + 3 + 1 tiles, 2 empty
    out = paged_attention(q, k_cache, v_cache, sliding_window=sliding_window, extend_tiles=tiles, **kwargs)
    assert_close_to_oracle(
        out, sdpa_over_image_groups(q, k_cache, v_cache, groups, sliding_window=sliding_window, **kwargs)
    )


# --- every path ------------------------------------------------------------------------------------


@pytest.fixture(params=["cpu-path", "reference", "kernel-interpreted"])
def attend_on_each_path(request):
    if request.param == "kernel-interpreted":
        request.getfixturevalue("triton_on_cpu")
        request.getfixturevalue("short_splits")
    return paged_attention_ref if request.param == "reference" else paged_attention


def test_decode_rows_ignore_lookahead(attend_on_each_path):
    """A decode row's lookahead is 0 (its token is text); whatever it holds changes nothing."""
    q, k_cache, v_cache, kwargs, groups = image_batch(
        *CASES["decode-rows-first"], (4, 2, 64), 3, torch.float32, "cpu", 7
    )
    kwargs["lookahead"][: kwargs["num_decode_rows"]] = 5
    out = attend_on_each_path(q, k_cache, v_cache, **kwargs)
    assert_close_to_oracle(
        out, sdpa_over_image_groups(q, k_cache, v_cache, groups, sliding_window=None, **kwargs)
    )


def test_rejects_a_lookahead_not_int32_of_one_per_query():
    q, k_cache, v_cache, kwargs, _ = image_batch(*CASES["one-image"], (4, 2, 64), 3, torch.float32, "cpu", 8)
    lookahead = kwargs.pop("lookahead")
    with pytest.raises(ValueError, match="lookahead must be an int32 tensor"):
        paged_attention(q, k_cache, v_cache, lookahead=lookahead.long(), **kwargs)
    with pytest.raises(ValueError, match="lookahead must be an int32 tensor"):
        paged_attention(q, k_cache, v_cache, lookahead=lookahead[1:], **kwargs)


# --- CUDA in bf16 ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize("case", [*CASES.values(), MIXED], ids=[*CASES.keys(), "mixed"])
@pytest.mark.usefixtures("short_splits")
def test_kernel_cuda_follows_image_groups_across_short_tiles(cuda, case, sliding_window):
    check_images(case, (4, 2, 64), 3, torch.bfloat16, cuda, 9, sliding_window)


# Gemma 3's images are 256 tokens. Rows: a chunk starting inside its first image (250..505), and
# a whole prompt of three images; decode rows before them.
GEMMA3_BATCH = (
    [1500, 1, 300],
    [(700, 1000, [(250, 256), (600, 256)]), (1000, 1000, [(10, 256), (300, 256), (700, 256)])],
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads", [(8, 4, 256), (16, 8, 256), (32, 16, 128)], ids=["gemma3-4b", "gemma3-12b", "gemma3-27b"]
)
# Longer than the images, and short enough to cut these rows (Gemma 3's is 1024).
@pytest.mark.parametrize("sliding_window", [None, 512])
@pytest.mark.parametrize("block_size", [16, None])
@pytest.mark.parametrize("tile_map", [False, True], ids=["grid", "tile-map"])
def test_kernel_cuda_follows_image_groups_at_real_shapes(cuda, heads, sliding_window, block_size, tile_map):
    """The kernel's own tiles (32 queries for head_dim 256, 128 for 128), which the images cross
    at other offsets each."""
    q, k_cache, v_cache, kwargs, groups = image_batch(
        *GEMMA3_BATCH, heads, block_size, torch.bfloat16, cuda, 10
    )
    if tile_map:
        tile_size = extend_module.extend_tile_size(heads[2])
        kwargs["extend_tiles"] = shuffled_tile_map(
            kwargs, tile_size, num_slots=2000 // tile_size + 8, seed=11
        ).to(cuda)
    out = paged_attention(q, k_cache, v_cache, sliding_window=sliding_window, **kwargs)
    assert_close_to_oracle(
        out, sdpa_over_image_groups(q, k_cache, v_cache, groups, sliding_window=sliding_window, **kwargs)
    )
