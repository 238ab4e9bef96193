"""Programmatic dependent launch (infer.kernels.pdl): the kernels launched with `pdl=True` compute
exactly what they compute launched plainly.

The GPU oracle is the same chain of kernels launched without PDL: the kernels and their arguments
are the same, so the outputs must be equal bit for bit. A kernel that read its input before the
kernel writing it had finished (a missing `gdc_wait`) would read stale or half-written values.
The chain is a decode layer's at Qwen3-8B widths, repeated, replayed from a CUDA graph as the
engine runs it, with the buffers of one layer's kernels rewritten by the next layer's.
"""

import pytest
import torch

from infer.kernels import (
    KVStore,
    add_rms_norm,
    paged_attention,
    qk_norm_rope,
    quantized_linear,
    rms_norm,
    rope_tables,
    silu_and_mul,
)
from infer.kernels.pdl import launch_options


def test_launch_options_are_plain_on_a_cpu_and_without_pdl():
    x = torch.zeros(4)
    assert launch_options(x, False) == {"PDL": False}
    assert launch_options(x, True) == {"PDL": False}  # no PDL on a CPU (or in Triton's interpreter)


HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 12288
BLOCK_SIZE, NUM_KEYS, MAX_KEYS, LAYERS = 16, 700, 4096, 6


def _int8(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=gen)
    scale = torch.rand(n, 1, device="cuda", generator=gen) / (64 * k**0.5)
    return weight, scale


def _decode_chain(gen: torch.Generator, max_seq_len: int):
    """A function that runs LAYERS decode layers (int8 projections, per channel; K of down_proj
    split with fp8 128x128 blocks, so its partial sums take a second kernel) on fixed buffers,
    the layers, and its input (a buffer read by the first kernel). `max_seq_len` sets the
    attention's splits: 4096 gives the engine's 16 at batch 1, one key tile each, so that this
    token's key lies in a first tile (read before the wait, but for that key); 1024 gives 4 of
    three tiles, and this token's key lies in the last split's second tile (read in the loop)."""
    layers = []
    for _ in range(LAYERS):
        down = torch.randn(HIDDEN, INTERMEDIATE, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        layers.append(
            dict(
                qkv=_int8((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, gen),
                o=_int8(HIDDEN, Q_HEADS * HEAD_DIM, gen),
                gate_up=_int8(2 * INTERMEDIATE, HIDDEN, gen),
                down=(
                    down,
                    torch.rand(HIDDEN // 128, INTERMEDIATE // 128, device="cuda", generator=gen) / 2000,
                ),
                norms=torch.rand(4, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16) + 0.5,
                qk_norms=torch.rand(2, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16) + 0.5,
                k_cache=torch.randn(
                    MAX_KEYS // BLOCK_SIZE, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", generator=gen
                ).to(torch.bfloat16),
            )
        )
    for layer in layers:
        layer["v_cache"] = layer["k_cache"].clone()
    num_blocks = layers[0]["k_cache"].shape[0]
    block_table = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)[None, :]
    position = NUM_KEYS - 1
    slot = (block_table[0, position // BLOCK_SIZE].long() * BLOCK_SIZE + position % BLOCK_SIZE).view(1)
    cos, sin = rope_tables(HEAD_DIM, NUM_KEYS, 1e6, device="cuda")
    positions = torch.tensor([position], device="cuda")
    x0 = torch.randn(1, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([NUM_KEYS], dtype=torch.int32, device="cuda")

    def run(pdl: bool) -> torch.Tensor:
        hidden, residual = rms_norm(x0, layers[0]["norms"][3], 1e-6, pdl=pdl), x0.clone()
        for layer in layers:
            h, residual = add_rms_norm(hidden, residual, layer["norms"][0], 1e-6, pdl=pdl)
            qkv = quantized_linear(h, *layer["qkv"], (1, HIDDEN), pdl=pdl)
            q, k, v = qkv.view(1, -1, HEAD_DIM).split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
            store = KVStore(v, layer["k_cache"], layer["v_cache"], slot)
            q, _ = qk_norm_rope(q, k, *layer["qk_norms"], 1e-6, cos, sin, positions, store=store, pdl=pdl)
            attn = paged_attention(
                q,
                layer["k_cache"],
                layer["v_cache"],
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_tables=block_table,
                num_decode_rows=1,
                max_query_len=1,
                max_seq_len=max_seq_len,
                scale=HEAD_DIM**-0.5,
                pdl=pdl,
            )
            o = quantized_linear(attn.view(1, -1), *layer["o"], (1, Q_HEADS * HEAD_DIM), pdl=pdl)
            h, residual = add_rms_norm(o, residual, layer["norms"][1], 1e-6, pdl=pdl)
            gate_up = quantized_linear(h, *layer["gate_up"], (1, HIDDEN), pdl=pdl)
            hidden = quantized_linear(silu_and_mul(gate_up, pdl=pdl), *layer["down"], (128, 128), pdl=pdl)
        return rms_norm(hidden + residual, layers[-1]["norms"][2], 1e-6, pdl=pdl)

    return run, layers, x0


def _replayed(run, layers, x0, inputs, *, pdl: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The chain's output for each of `inputs` (copied into x0 before each replay of one captured
    graph), and the layers' caches after the last. Each replay writes this token's key and value
    to the same cache slot, from a different input: a kernel that read the slot before the
    kernel writing it had finished would see the replay before's."""
    x0.copy_(inputs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(pdl)  # compiles every kernel variant outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(pdl)
    outputs = []
    for x in inputs[1:]:
        x0.copy_(x)
        graph.replay()
        outputs.append(out.clone())
    torch.cuda.synchronize()
    return outputs, [layer["k_cache"].clone() for layer in layers]


@pytest.mark.gpu
@pytest.mark.parametrize("max_seq_len", [MAX_KEYS, 1024])
def test_a_decode_chain_launched_with_pdl_computes_exactly_what_plain_launches_do(max_seq_len):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0 or newer")
    assert launch_options(torch.zeros(1, device="cuda"), True) == {"PDL": True, "launch_pdl": True}
    gen = torch.Generator(device="cuda").manual_seed(0)
    run, layers, x0 = _decode_chain(gen, max_seq_len)
    inputs = [torch.randn(x0.shape, device="cuda", generator=gen).to(x0.dtype) for _ in range(4)]
    plain, plain_caches = _replayed(run, layers, x0, inputs, pdl=False)
    for out in plain:
        assert out.isfinite().all() and out.abs().max() > 0
    assert not torch.equal(plain[0], plain[1])
    for attempt in range(3):  # a race shows up on some replays and not others
        with_pdl, pdl_caches = _replayed(run, layers, x0, inputs, pdl=True)
        for replay, (have, want) in enumerate(zip(with_pdl, plain, strict=True)):
            difference = (have.float() - want.float()).abs().max().item()
            assert torch.equal(have, want), (attempt, replay, difference)
        for layer, (have, want) in enumerate(zip(pdl_caches, plain_caches, strict=True)):
            assert torch.equal(have, want), (attempt, layer)
