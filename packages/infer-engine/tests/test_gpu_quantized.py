"""On CUDA in bf16 with real shapes: 8-bit weights (fp8 and int8 checkpoints, int8 at load) and
4-bit ones (GPTQ and AWQ checkpoints, int4 at load).

Two oracles: the same checkpoint dequantized by plain torch into a dense model of ours (the
logits of one forward), and the recompute oracle over the 8-bit model (greedy tokens of the
engine with chunked prefill, CUDA graphs and async scheduling, up to a bf16 near tie, as in
test_gpu.py).
"""

import gc
import math

import pytest
import torch

from conformance.oracles import RecomputeOracle
from infer.engine import Engine, EngineConfig, SamplingParams
from infer.engine.config import AUTO_FLAGS
from infer.kernels import dequantize_int4
from infer.models.forward_batch import ForwardBatch
from infer.models.kernel_policy import KernelPolicy, apply_kernel_policy
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

from .conftest import drop_weight_files
from .test_gpu import assert_equal_up_to_a_near_tie, run_together

PRESET = "llama-3.2-1b"
NUM_TOKENS = 32
PROMPT_LENGTHS = (40, 300)


def dequantized_copy(model):
    """Our dense bf16 twin of a quantized model: each 8-bit Linear's weight times its block
    scales, each 4-bit one's as infer.kernels' reference dequantizes it (act-order undone)."""
    import copy

    dense = copy.deepcopy(model)
    for module in dense.modules():
        if getattr(module, "group_size", None) is not None:
            weight = dequantize_int4(
                module.weight, module.weight_scale, module.weight_zero, module.group_size
            )
            if module.input_perm is not None:
                weight = torch.empty_like(weight).index_copy_(1, module.input_perm, weight)
            module.weight = torch.nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
            module.weight_scale = module.weight_zero = module.input_perm = module.group_size = None
            continue
        if getattr(module, "block_size", None) is None:
            continue
        rows, cols = module.block_size
        scale = module.weight_scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        weight = module.weight.float() * scale[: module.out_features, : module.in_features]
        module.weight = torch.nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
        module.weight_scale = module.block_size = None
    # Methods are chosen when a model is built: the twin's Linears are dense now.
    return apply_kernel_policy(dense, KernelPolicy(next(dense.parameters()).device))


@pytest.fixture(scope="module", params=["fp8", "int8", "int8-at-load", "gptq", "awq", "int4-at-load"])
def quantized(request, tmp_path_factory):
    method = request.param.removesuffix("-at-load")
    at_load = request.param.endswith("at-load")
    folder = make_random_checkpoint(
        PRESET,
        tmp_path_factory.mktemp(request.param),
        dtype=torch.bfloat16,
        quantization=None if at_load else method,
    )
    loaded = load_model(folder, dtype=torch.bfloat16, device="cuda", quantization=method if at_load else None)
    drop_weight_files(folder)
    assert loaded.model.quantization.method == method
    return request.param, loaded


@pytest.mark.gpu
@torch.inference_mode()
def test_a_quantized_model_gives_the_logits_of_its_dequantized_weights(quantized):
    """bf16 both sides: the 8-bit kernels accumulate in fp32 as cuBLAS does, so the logits
    differ by summation order and rounding only, a few bf16 units at the logits' magnitude.
    (The 4-bit twin's weights are rounded to bf16 besides: 8 units is not measured for them.)"""
    name, loaded = quantized
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.config.vocab_size, (64,), generator=generator).tolist()
    batch = ForwardBatch.from_tokens([prompt], device="cuda")
    ours = loaded.model.compute_logits(loaded.model(batch))
    dense = dequantized_copy(loaded.model)
    expected = dense.compute_logits(dense(batch))
    scale = expected.abs().max().item()
    bf16_unit = 2.0 ** (math.floor(math.log2(scale)) - 7)
    error = (ours - expected).abs().max().item()
    print(f"{name}: largest logit error {error / bf16_unit:.1f} bf16 units at {scale:.1f}")
    # On an H100: 2.8 units (fp8), 3.6 (int8, stored or quantized at load) at logits near 21.
    assert error <= 8 * bf16_unit, name


@pytest.mark.gpu
def test_a_quantized_model_decodes_as_its_recompute_oracle_with_graphs(quantized):
    name, loaded = quantized
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, loaded.config.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS
    ]
    params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    config = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        max_batch_size=4,
        max_seq_len=1024,
        use_chunked_prefill=True,
        prefill_chunk_size=64,
        use_cuda_graphs=True,
        async_scheduling=True,
    )
    engine = Engine(config, loaded_model=loaded)
    oracle = RecomputeOracle(loaded)
    for prompt, ours in zip(prompts, run_together(engine, prompts, params), strict=True):
        expected = oracle.generate(prompt, params).token_ids
        assert_equal_up_to_a_near_tie(loaded.model, prompt, ours, expected, f"{PRESET}/{name}")


@pytest.mark.gpu
def test_the_memory_limit_holds_the_engine_and_sizes_its_kv_pool(quantized):
    """device_memory_limit_gib: the pool takes its fraction of what the limit leaves after the
    weights, and the allocator refuses to go past the limit."""
    name, loaded = quantized
    # Earlier tests' engines, freed now rather than mid-test (their memory would go back to the
    # allocator's cache, where a request under the limit could take it).
    gc.collect()
    torch.cuda.empty_cache()
    start_bytes = torch.cuda.memory_reserved()
    limit_bytes = start_bytes + 2**30
    # Eager steps, as every switch was before the device's defaults: what is under test is the
    # pool's share of the limit, not the graphs' memory.
    config = EngineConfig(
        device="cuda", dtype="bfloat16", max_batch_size=2, max_seq_len=512,
        kv_cache_memory_fraction=0.5, device_memory_limit_gib=limit_bytes / 2**30,
        **dict.fromkeys(AUTO_FLAGS, False),
    )  # fmt: skip
    try:
        engine = Engine(config, loaded_model=loaded)
        block_bytes = engine.core.kv_pool.shape.bytes_per_block()
        pool_bytes = block_bytes * engine.core.kv_pool.num_blocks
        assert 0 < pool_bytes <= 0.5 * (limit_bytes - start_bytes) + block_bytes, (pool_bytes, start_bytes)
        torch.cuda.empty_cache()
        past_the_limit = limit_bytes - torch.cuda.memory_reserved() + 2**26
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(past_the_limit, dtype=torch.uint8, device="cuda")
        torch.empty(past_the_limit - 2**27, dtype=torch.uint8, device="cuda")  # just under it: fine
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
