"""On CUDA in bf16 with real shapes: greedy tokens of every engine configuration (paged, contiguous,
chunked prefill at 16 / 64 / 512 tokens, preemption forced by a tiny pool, CUDA graphs, PDL, the
Triton GEMV) equal the recompute oracle's (no cache, the whole sequence every token).

bf16 rounds the engine's path (prompt chunks and one-token rows against stored keys) and the
recompute path (the whole sequence at once) differently, so a genuine near-tie between the top two
logits may flip. Equality is required except at such a tie: at the first differing step, the
recompute path's logits of the two chosen tokens must be within TIE_ULPS bf16 units in the last
place of each other (at their magnitude), and the comparison ends there (the sequences
legitimately diverge afterwards). The logits come out of a bf16 LM head, so one unit is the
smallest gap they can show: 0.125 at magnitudes 16-32, 0.25 at 32-64 (measured on an H100: a
600-token prompt of llama-3.2-1b shapes flips at a gap of 0.25, one unit).
"""

import importlib
import json
import math
import re
import shutil

import pytest
import torch

from conformance.oracles import RecomputeOracle
from infer.engine import Engine, EngineConfig, SamplingParams
from infer.engine.config import AUTO_FLAGS
from infer.engine.grammar_spec import GrammarSpec
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

REAL_SHAPE_PRESETS = ["llama-3.2-1b", "qwen3-1.7b", "gemma-3-1b"]
NUM_TOKENS = 32
PROMPT_LENGTHS = (40, 150, 600)
# Two bf16 units in the last place of the larger logit.
TIE_ULPS = 2
# Each config names every switch whose default depends on the device (PLAIN: all off), so that
# it means the same run whatever the defaults; "defaults" is what `infer serve` runs unasked.
PLAIN = dict.fromkeys(AUTO_FLAGS, False)
CONFIGS = {
    "defaults": {},
    "paged": PLAIN,
    "contiguous": PLAIN | dict(kv_cache_backend="contiguous"),
    "chunked-16": PLAIN | dict(use_chunked_prefill=True, prefill_chunk_size=16),
    "chunked-64": PLAIN | dict(use_chunked_prefill=True, prefill_chunk_size=64),
    "chunked-512": PLAIN | dict(use_chunked_prefill=True, prefill_chunk_size=512),
    # 45 blocks of 16 for three requests of up to 632 tokens (40 blocks): decodes outgrow it.
    "preempted": PLAIN | dict(num_gpu_blocks=45, use_chunked_prefill=True, prefill_chunk_size=64),
    "graphs": PLAIN | dict(use_cuda_graphs=True, use_chunked_prefill=True, prefill_chunk_size=64),
    "graphs-async": PLAIN
    | dict(use_cuda_graphs=True, use_chunked_prefill=True, prefill_chunk_size=64, async_scheduling=True),
    "graphs-async-pdl": PLAIN
    | dict(
        use_cuda_graphs=True,
        use_chunked_prefill=True,
        prefill_chunk_size=64,
        async_scheduling=True,
        use_pdl=True,
    ),
    "preempted-async": PLAIN
    | dict(num_gpu_blocks=45, use_chunked_prefill=True, prefill_chunk_size=64, async_scheduling=True),
}
CONFIGS["graphs-async-pdl-gemv"] = CONFIGS["graphs-async-pdl"] | dict(use_triton_gemv=True)


@pytest.fixture(scope="module", params=REAL_SHAPE_PRESETS)
def real_shape(request, tmp_path_factory):
    folder = make_random_checkpoint(
        request.param, tmp_path_factory.mktemp(request.param), dtype=torch.bfloat16
    )
    loaded = load_model(folder, dtype=torch.bfloat16, device="cuda")
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, loaded.config.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS
    ]
    params = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    oracle = RecomputeOracle(loaded)
    expected = [oracle.generate(prompt, params).token_ids for prompt in prompts]
    yield request.param, loaded, prompts, params, expected
    # Kept while its tests run (a speculative test loads it again as its own draft), deleted
    # after: every pytest-xdist worker writes each preset's gigabytes, and kept for the whole run
    # they filled the GPU machine's 64 GiB disk.
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", CONFIGS)
def test_engine_greedy_equals_recompute_in_bf16_up_to_a_near_tie(real_shape, config_name):
    preset, loaded, prompts, params, expected = real_shape
    engine = real_shape_engine(loaded, **CONFIGS[config_name])
    tokens = run_together(engine, prompts, params)
    if config_name.startswith("preempted"):
        assert engine.stats().num_preempted > 0
    for prompt, ours, oracle_tokens in zip(prompts, tokens, expected, strict=True):
        assert_equal_up_to_a_near_tie(loaded.model, prompt, ours, oracle_tokens, f"{preset}/{config_name}")


@pytest.mark.gpu
def test_batch_1_decode_with_pdl_and_the_triton_gemv_equals_recompute_up_to_a_near_tie(real_shape):
    """Each prompt alone: every decode step is one row, the only steps launched with PDL (where
    decode attention reads all but this token's key before waiting for the kernel before) and
    the ones the Triton GEMV serves, replayed from a CUDA graph."""
    preset, loaded, prompts, params, expected = real_shape
    engine = real_shape_engine(loaded, **CONFIGS["graphs-async-pdl-gemv"])
    for prompt, oracle_tokens in zip(prompts, expected, strict=True):
        (ours,) = run_together(engine, [prompt], params)
        assert_equal_up_to_a_near_tie(loaded.model, prompt, ours, oracle_tokens, f"{preset}/batch-1")
    assert engine.core.runner.graphs.num_replays["decode"] > 0


def real_shape_engine(loaded, **settings) -> Engine:
    """An engine over a real shape's loaded model: bf16 on CUDA, up to 4 rows of 1024 tokens."""
    config = EngineConfig(device="cuda", dtype="bfloat16", max_batch_size=4, max_seq_len=1024, **settings)
    return Engine(config, loaded_model=loaded)


def run_together(engine: Engine, prompts, params) -> list[list[int]]:
    """The prompts added at once and run to the end: each one's tokens, in order."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    tokens = {request_id: [] for request_id in ids}
    while engine.has_work():
        for output in engine.step():
            assert output.error is None, output.error
            if output.token_id is not None:
                tokens[output.request_id].append(output.token_id)
    return [tokens[request_id] for request_id in ids]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs_async", [False, True], ids=["eager", "graphs-async"])
def test_prefix_cache_hits_give_the_recompute_tokens_in_bf16_up_to_a_near_tie(real_shape, graphs_async):
    """A first wave fills the cache; a second wave hits it once per kind (a prefix: the first
    answer's conversation continued; a supersequence: a shorter prompt; an LCP: a prompt that
    parts mid-way), each checked against recomputing its whole sequence."""
    preset, loaded, prompts, params, _ = real_shape
    settings = dict(use_chunked_prefill=True, prefill_chunk_size=64, use_prefix_caching=True)
    if graphs_async:
        settings |= dict(use_cuda_graphs=True, async_scheduling=True)
    engine = real_shape_engine(loaded, **settings)
    first_wave = run_together(engine, prompts, params)
    vocab = loaded.config.vocab_size
    follow_ups = [
        prompts[0] + first_wave[0] + [1, 2, 3],
        prompts[1][:120],
        prompts[2][:300] + [(prompts[2][300] + 1) % vocab] + prompts[2][301:320],
    ]
    oracle = RecomputeOracle(loaded)
    for prompt, ours in zip(follow_ups, run_together(engine, follow_ups, params), strict=True):
        oracle_tokens = oracle.generate(prompt, params).token_ids
        assert_equal_up_to_a_near_tie(loaded.model, prompt, ours, oracle_tokens, f"{preset}/prefix-cache")
    counts = engine.core.scheduler.kv_manager.match_counts
    assert counts["prefix"] >= 1 and counts["supersequence"] >= 1 and counts["lcp"] >= 1, counts


@pytest.mark.gpu
def test_hits_restored_from_the_host_tier_give_the_tokens_of_hits_kept_on_the_device(real_shape):
    """Three 600-token conversations, then each one again with more: with a pool of 80 blocks and
    a host tier, the older conversations go to pinned host memory and their follow-ups restore
    them; with a pool of 400, they stay on the device. The host tier copies K/V bit for bit and
    the steps are the same, so the greedy tokens are identical, not near ties."""
    preset, loaded, _, _, _ = real_shape
    generator = torch.Generator().manual_seed(2)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(0, vocab, (600,), generator=generator).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    settings = dict(use_chunked_prefill=True, prefill_chunk_size=256, use_prefix_caching=True)
    engines = {
        "device": real_shape_engine(loaded, **settings, num_gpu_blocks=400),
        "host": real_shape_engine(loaded, **settings, num_gpu_blocks=80, kv_host_cache_gib=1.0),
    }
    answers = {}
    for name, engine in engines.items():
        first = [run_together(engine, [prompt], params)[0] for prompt in prompts]
        follow_ups = [prompt + answer + [1, 2, 3] for prompt, answer in zip(prompts, first, strict=True)]
        answers[name] = first + [run_together(engine, [prompt], params)[0] for prompt in follow_ups]
    tree = engines["host"].core.prefix_tree
    assert tree.num_restored_total > 0 and tree.num_evicted_blocks == 0
    assert answers["host"] == answers["device"], f"{preset}: host-tier hits answered differently"
    assert engines["host"].core.stats().prefix_cache_store == "host"
    for engine in engines.values():
        engine.shutdown()


@pytest.mark.gpu
def test_int8_prefix_cache_hits_on_the_gpu_agree_with_unquantized_hits(real_shape, capsys):
    """Three 600-token conversations in a pool of 80 blocks: the oldest go int8 when the third
    runs; each conversation then goes on, restoring its blocks. Random weights make every logit a
    near tie, so the agreement with the same hits unquantized is reported; the bar only tells a
    working restore from a broken one (another block's K/V agrees with nothing)."""
    preset, loaded, _, _, _ = real_shape
    generator = torch.Generator().manual_seed(1)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(0, vocab, (600,), generator=generator).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    settings = dict(
        device="cuda",
        dtype="bfloat16",
        max_batch_size=2,
        max_seq_len=1024,
        use_chunked_prefill=True,
        prefill_chunk_size=256,
        use_prefix_caching=True,
    )
    engines = {
        "unquantized": Engine(EngineConfig(**settings, num_gpu_blocks=400), loaded_model=loaded),
        "int8": Engine(
            EngineConfig(
                **settings, num_gpu_blocks=160, prefix_cache_kv_bits=8, prefix_cache_quantized_fraction=0.5
            ),
            loaded_model=loaded,
        ),
    }
    answers = {}
    for name, engine in engines.items():
        first = [run_together(engine, [prompt], params)[0] for prompt in prompts]
        follow_ups = [prompt + answer + [1, 2, 3] for prompt, answer in zip(prompts, first, strict=True)]
        answers[name] = [run_together(engine, [prompt], params)[0] for prompt in follow_ups]
    tree = engines["int8"].core.prefix_tree
    assert tree.num_restored_total > 0
    pairs = list(zip(answers["int8"], answers["unquantized"], strict=True))
    first_token = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    parted = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) for a, b in pairs
    ]
    for engine in engines.values():
        engine.shutdown()
    share = sum(parted) / sum(len(a) for a, _ in pairs)
    with capsys.disabled():
        print(
            f"\n{preset}: int8 prefix-cache hits vs unquantized hits: first token {first_token:.0%}, "
            f"{share:.0%} of tokens before they part ({tree.num_restored_total} blocks restored)"
        )
    assert share >= 0.3


@pytest.mark.gpu
@pytest.mark.parametrize("use_cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_no_step_compiles_a_kernel_after_start_up(real_shape, use_cuda_graphs):
    """A Triton compile inside a step stalls every stream of that step, so start-up must have
    compiled whatever serving runs: steps of 1-5 rows, decode-only and mixed, chunks after
    decodes, short and long contexts."""
    _, loaded, prompts, _, _ = real_shape
    config = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        max_batch_size=8,
        max_seq_len=1024,
        use_chunked_prefill=True,
        prefill_chunk_size=48,
        use_cuda_graphs=use_cuda_graphs,
    )
    engine = Engine(config, loaded_model=loaded)
    compiled = compiled_kernel_variants()
    generator = torch.Generator().manual_seed(1)
    lengths = (1, 7, 33, *PROMPT_LENGTHS, 17, 900)
    for i, length in enumerate(lengths):
        prompt = torch.randint(0, loaded.config.vocab_size, (length,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=3 + 5 * i, ignore_eos=True))
        for _ in range(i % 3 + 1):  # arrivals while others decode
            engine.step()
    while engine.has_work():
        engine.step()
    assert_no_kernel_compiled_since(compiled)


def assert_no_kernel_compiled_since(compiled: dict[str, int]) -> None:
    """`compiled`: compiled_kernel_variants() then; names the kernels that gained variants."""
    now = compiled_kernel_variants()
    gained = {
        name: (compiled.get(name, 0), count) for name, count in now.items() if count != compiled.get(name, 0)
    }
    assert not gained, f"kernels compiled after start-up (variants then, now): {gained}"


def compiled_kernel_variants() -> dict[str, int]:
    """How many compiled variants each of infer.kernels' Triton kernels holds (all devices)."""
    from triton.runtime.jit import JITFunction

    counts = {}
    for module_name in ("paged_attention", "store_kv", "rope", "rms_norm", "activation"):
        module = importlib.import_module(f"infer.kernels.{module_name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction):
                # device_caches: device -> (kernel cache, ...), the layout of Triton 3.x.
                counts[f"{module_name}.{name}"] = sum(len(c[0]) for c in value.device_caches.values())
    return counts


def assert_equal_up_to_a_near_tie(model, prompt, ours, oracle_tokens, label) -> None:
    assert len(ours) == len(oracle_tokens) == NUM_TOKENS
    first_difference = next(
        (i for i, (a, b) in enumerate(zip(ours, oracle_tokens, strict=True)) if a != b), None
    )
    if first_difference is None:
        return
    with torch.inference_mode():
        sequence = prompt + oracle_tokens[:first_difference]
        hidden = model(ForwardBatch.from_tokens([sequence], device="cuda"))
        logits = model.compute_logits(hidden[-1:])[0].float()
    theirs, mine = logits[oracle_tokens[first_difference]].item(), logits[ours[first_difference]].item()
    gap = theirs - mine
    assert gap <= TIE_ULPS * bf16_ulp(max(abs(theirs), abs(mine))), (
        f"{label}, prompt of {len(prompt)}: step {first_difference} chose {ours[first_difference]}, "
        f"the oracle {oracle_tokens[first_difference]}; their logits differ by {gap:.3f}, "
        f"more than {TIE_ULPS} bf16 units at that magnitude"
    )


def bf16_ulp(magnitude: float) -> float:
    """The spacing of bf16 numbers at `magnitude` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(magnitude, 2.0**-126))) - 7)


# Every value bounded, so that even a random model's argmax ends the object in a few dozen tokens.
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": -50, "maximum": 50},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.mark.gpu
def test_structured_output_holds_a_random_model_to_its_grammar_with_graphs_and_async(real_shape):
    """Random weights want nothing in particular: whatever they emit is the grammar's doing. The
    masks go through pinned buffers, the Triton bitmask kernel, CUDA graphs and async scheduling."""
    import jsonschema

    preset, loaded, prompts, _, _ = real_shape
    engine = Engine(
        EngineConfig(max_batch_size=4, max_seq_len=1024, **CONFIGS["graphs-async"]), loaded_model=loaded
    )
    schema = GrammarSpec.json_schema(BOUNDED_SCHEMA)
    pattern = r"[a-z]{3,8}-[0-9]{2}"
    kinds = {
        engine.add_request(
            prompts[0], SamplingParams(temperature=0, max_new_tokens=256, grammar=schema)
        ): "json",
        engine.add_request(
            prompts[1], SamplingParams(temperature=1.0, seed=1, max_new_tokens=256, grammar=schema)
        ): "json",
        engine.add_request(
            prompts[2],
            SamplingParams(temperature=0.8, seed=2, max_new_tokens=64, grammar=GrammarSpec.regex(pattern)),
        ): "regex",
        engine.add_request(
            prompts[0], SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
        ): "plain",
    }
    tokens, finish = {rid: [] for rid in kinds}, {}
    while engine.has_work():
        for output in engine.step():
            if output.token_id is not None:
                tokens[output.request_id].append(output.token_id)
            if output.finished:
                finish[output.request_id] = (output.finish_reason, output.error)
    for request_id, kind in kinds.items():
        text = loaded.tokenizer.decode(tokens[request_id], skip_special_tokens=True)
        if kind == "plain":
            assert len(tokens[request_id]) == 32 and finish[request_id] == ("length", None)
            continue
        assert finish[request_id] == ("stop", None), f"{preset}: {finish[request_id]} {text!r}"
        if kind == "json":
            jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
        else:
            assert re.fullmatch(pattern, text, re.ASCII), f"{preset}: {text!r}"
