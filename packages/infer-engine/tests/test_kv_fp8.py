"""The fp8 KV cache (kv_cache_dtype) through the engine: refused where it cannot run (a CPU, the
int8 cold store on top), and on CUDA an engine whose pool holds about twice the tokens of the
bf16 pool in the same memory (its statistics say so), and whose greedy tokens with hits restored
from the host tier equal those of hits kept on the device, eager and in CUDA graphs (an fp8
block's values and scales move bit for bit).
The numerics against a bf16 cache are specs/parity's PAR-023 and PAR-024."""

import pytest
import torch

from infer.engine import Engine, EngineConfig, SamplingParams
from infer.engine.config import EngineConfigError
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

from .conftest import drop_weight_files
from .test_gpu import run_together


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype must be one of"),
        ({"kv_cache_dtype": "fp8", "device": "cpu"}, "needs a CUDA device"),
        ({"kv_cache_dtype": "fp8", "prefix_cache_kv_bits": 8}, "would not shrink its blocks"),
    ],
)
def test_fp8_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(**settings)


def test_an_fp8_cache_on_a_cpu_is_refused_when_the_device_is_chosen(tiny_models):
    """device auto resolves to the CPU here: the build, not the config, knows it."""
    if torch.cuda.is_available():
        pytest.skip("device auto is CUDA here")
    with pytest.raises(EngineConfigError, match="needs a CUDA device"):
        Engine(EngineConfig(kv_cache_dtype="fp8"), loaded_model=tiny_models["llama-tiny"].loaded)


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    folder = make_random_checkpoint("llama-3.2-1b", tmp_path_factory.mktemp("llama"), dtype=torch.bfloat16)
    loaded = load_model(folder, dtype=torch.bfloat16, device="cuda")
    drop_weight_files(folder)
    return loaded


def engine_of(loaded, **settings) -> Engine:
    config = EngineConfig(device="cuda", dtype="bfloat16", max_batch_size=4, max_seq_len=1024, **settings)
    return Engine(config, loaded_model=loaded)


@pytest.mark.gpu
def test_an_fp8_pool_holds_about_twice_the_tokens_of_bf16_in_the_same_memory(llama_1b):
    stats = {}
    for dtype in ("auto", "fp8"):
        engine = engine_of(llama_1b, kv_cache_dtype=dtype, kv_cache_memory_fraction=0.2)
        stats[dtype] = engine.stats()
        engine.shutdown()
    bf16, fp8 = stats["auto"], stats["fp8"]
    assert (bf16.kv_cache_dtype, fp8.kv_cache_dtype) == ("bfloat16", "float8_e4m3fn")
    per_gib = {name: s.kv_tokens_total / s.kv_bytes_total for name, s in stats.items()}
    # head_dim 64: 64 value bytes and one scale byte a vector against bf16's 128 bytes.
    assert per_gib["fp8"] / per_gib["auto"] == pytest.approx(128 / 65, rel=0.01)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs-async"])
def test_fp8_hits_restored_from_host_memory_give_the_tokens_of_hits_kept_on_the_device(llama_1b, graphs):
    """Three 600-token conversations, then each again with more: with the device's cache (a pool
    of 400 blocks keeps them), and with a pool of 80 blocks and the host tier. An fp8 block's
    values and scales are restored bit for bit and the steps are the same, so the greedy tokens
    are identical, not near ties."""
    generator = torch.Generator().manual_seed(2)
    vocab = llama_1b.config.vocab_size
    prompts = [torch.randint(0, vocab, (600,), generator=generator).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    settings = dict(kv_cache_dtype="fp8", use_chunked_prefill=True, prefill_chunk_size=256)
    if graphs:
        settings |= dict(use_cuda_graphs=True, async_scheduling=True)
    engines = {
        "device": engine_of(llama_1b, **settings, use_prefix_caching=True, num_gpu_blocks=400),
        "host": engine_of(
            llama_1b, **settings, use_prefix_caching=True, num_gpu_blocks=80, kv_host_cache_gib=1.0
        ),
    }
    answers = {}
    for name, engine in engines.items():
        first = [run_together(engine, [prompt], params)[0] for prompt in prompts]
        follow_ups = [prompt + answer + [1, 2, 3] for prompt, answer in zip(prompts, first, strict=True)]
        answers[name] = first + [run_together(engine, [prompt], params)[0] for prompt in follow_ups]
    assert engines["host"].core.prefix_tree.num_restored_total > 0
    assert engines["device"].core.prefix_tree.num_restored_total == 0
    assert answers["host"] == answers["device"], "fp8 hits restored from host memory answered differently"
    for engine in engines.values():
        engine.shutdown()
