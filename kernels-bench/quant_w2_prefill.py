"""One weight format of a checkpoint in one engine (docs/benchmarks/quantization.md: qwen3-8b
shapes on an H200): W2 at concurrency 16 through the engine alone (as `infer bench engine-only
--workload W2 --concurrency 16 --repeats 2` runs it: an untimed warm-up of 8 requests of another
seed, then 2 timed runs of 32 requests, seeds 0 and 1), then the prefill of one 2048-token random
prompt (as `infer bench generate` times it: wall time to the first token, a cache salt a run so
the prefix cache serves nothing; one untimed run, 3 timed). Writes OUT.json after each part.

    python kernels-bench/quant_w2_prefill.py CHECKPOINT none|int4|int8|fp8 OUT.json [--device cpu --small]

Engine: the device's defaults (CUDA graphs, async scheduling, chunked prefill of 512, PDL, the
Triton GEMV), max_batch_size 16, max_seq_len 4096; bf16 with a fixed pool of 2048 blocks, the
quantized formats quantized at load under device_memory_limit_gib 16 with
kv_cache_memory_fraction 0.7 (the H100 W2 table's settings). --small: a dry run's counts (2
clients, a 64-token prompt) on a CPU.
"""

import argparse
import gc
import json
import statistics
import time

from infer.bench.generation import environment, random_prompt, time_generation
from infer.bench.serving.engine_only import run_engine_only
from infer.bench.serving.matrix import run_seed
from infer.bench.serving.workloads import SHAPES, WorkloadShape, make_workload
from infer.engine import Engine, EngineConfig, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint")
parser.add_argument("quantization", choices=["none", "int4", "int8", "fp8"])
parser.add_argument("out")
parser.add_argument("--device", default="cuda")
parser.add_argument("--small", action="store_true")
args = parser.parse_args()
concurrency, num_warm_up, prefill_tokens = (2, 2, 64) if args.small else (16, 8, 2000)
# --small: W2's requests shortened to fit a tiny model's 256 positions.
shape = (
    WorkloadShape("completion", prompt_tokens=(8, 64), output_tokens=(4, 16)) if args.small else SHAPES["W2"]
)

started = time.perf_counter()
settings = dict(model=args.checkpoint, device=args.device, dtype="bfloat16", max_batch_size=16)
settings |= dict(max_seq_len=256 if args.small else 2048)
if args.quantization != "none":
    settings |= dict(quantization=args.quantization)
if args.device == "cuda":
    if args.quantization == "none":
        settings |= dict(num_gpu_blocks=2048)
    else:
        settings |= dict(device_memory_limit_gib=16, kv_cache_memory_fraction=0.7)
engine = Engine(EngineConfig(**settings))
load_s = time.perf_counter() - started
print(f"{args.quantization}: engine built in {load_s:.1f} s; {engine.settings_line}", flush=True)
# As `infer bench engine-only` does: what start-up built stays out of the collector's scans.
gc.collect()
gc.freeze()

# The CLI's default (32000), or a tiny model's smaller vocabulary.
vocab_size = min(32000, engine.model_info.config.vocab_size)
warm_up = make_workload(
    "W2",
    concurrency=concurrency,
    seed=run_seed(0, "warm-up", concurrency),
    num_requests=num_warm_up,
    shape=shape,
    vocab_size=vocab_size,
)
run_engine_only(engine, warm_up)
w2_runs = []
for repeat in range(2):
    workload = make_workload("W2", concurrency=concurrency, seed=repeat, shape=shape, vocab_size=vocab_size)
    w2_runs.append({"repeat": repeat, **run_engine_only(engine, workload)})
    print(
        f"{args.quantization}: W2 c{concurrency} run {repeat}: "
        f"{w2_runs[-1]['output_tokens_per_s']:.1f} out tok/s, "
        f"TTFT p50 {w2_runs[-1]['ttft_p50_ms']:.1f} ms",
        flush=True,
    )

report = {
    "quantization": args.quantization,
    "engine_config": engine.config.to_dict(),
    "settings": engine.settings_line,
    "environment": environment(engine.core.device),
    "engine_build_s": load_s,
    "w2": {"workload": workload.describe(), "runs": w2_runs},
}


def write_report() -> None:
    """Written after W2 and again after prefill: a run cut off by its time limit keeps W2."""
    report["wall_s"] = time.perf_counter() - started
    with open(args.out, "w") as file:
        json.dump(report, file, indent=1, default=str)


write_report()
prompt = random_prompt(engine.model_info, prefill_tokens, seed=0)
params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
time_generation(engine, prompt, params, cache_salt="warm-up")
prefill = [time_generation(engine, prompt, params, cache_salt=f"run-{run}")[0] for run in range(3)]
prefill_tok_s = [timing.prefill_tokens_per_s for timing in prefill]
print(
    f"{args.quantization}: prefill of {prefill_tokens} tokens: "
    f"median {statistics.median(prefill_tok_s):.1f} tok/s "
    f"({', '.join(f'{x:.1f}' for x in prefill_tok_s)})",
    flush=True,
)

report["prefill"] = {
    "prompt_tokens": prefill_tokens,
    "tokens_per_s": prefill_tok_s,
    "median_tokens_per_s": statistics.median(prefill_tok_s),
}
write_report()
engine.shutdown()
gc.unfreeze()
