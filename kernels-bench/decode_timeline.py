"""Where a batch-1 decode step's time goes on the GPU (issue 15's first measurement).

For each checkpoint: the engine with CUDA graphs and async scheduling decodes 256 tokens after a
256-token prompt (the W1 shape) three times; the third run is profiled over 20 decode steps with
torch.profiler, which records every kernel of the graph replays. Printed: the unprofiled decode
tok/s and % of the memory roofline, the step's period against the time its kernels ran (the rest
is gaps between kernels: launch latency inside the graph, and host time between steps), the
kernels' time by kind, and each projection's GEMV time and bandwidth as a % of the copy
bandwidth. Steps are split at their first host-to-device copy (the graph's inputs).

    python kernels-bench/decode_timeline.py /tmp/ckpt/llama-3.2-1b /tmp/ckpt/gemma-3-1b ...
    python kernels-bench/decode_timeline.py /tmp/ckpt/q8b --use-pdl --use-triton-gemv --by-kernel \
        --quantization int8 --device-memory-limit-gib 16
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from infer.bench.generation import decode_roofline
from infer.engine import Engine, EngineConfig, SamplingParams

PROMPT_TOKENS, NEW_TOKENS, PROFILED_FROM, PROFILED_STEPS = 256, 256, 100, 20
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
KINDS = (
    ("matmul", ("nvjet", "gemv", "gemm", "splitKreduce", "cutlass", "_split_k_sum")),
    ("attention", ("_decode_split", "_decode_merge", "paged_attention")),
    ("norm", ("rms_norm",)),
    ("rope", ("_rope",)),
    ("store_kv", ("store_kv",)),
    ("activation", ("activation",)),
    ("sampling", ("ArgMax", "argmax", "sample")),
    ("copies", ("Memcpy", "Memset", "memcpy")),
)


def kind_of(kernel: str) -> str:
    return next((kind for kind, marks in KINDS if any(mark in kernel for mark in marks)), "other")


def is_matmul(kernel: str) -> bool:
    return kind_of(kernel) == "matmul" and not is_split_k_sum(kernel)


def is_split_k_sum(kernel: str) -> bool:
    return "splitKreduce" in kernel or "_split_k_sum" in kernel


def decode(engine: Engine, profiled: bool) -> tuple[float, list[dict]]:
    """Decode tok/s of one W1 request; with `profiled`, the kernels of PROFILED_STEPS steps."""
    prompt = [100 + (7 * i) % 5000 for i in range(PROMPT_TOKENS)]
    engine.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    num_tokens, first, prof, kernels = 0, None, None, []
    while engine.has_work():
        if profiled and num_tokens == PROFILED_FROM and prof is None:
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        got = sum(output.token_id is not None for output in engine.step())
        if got and first is None:
            first = time.perf_counter()
        elif first is not None:
            num_tokens += got
        if prof is not None and num_tokens >= PROFILED_FROM + PROFILED_STEPS + 2:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            kernels = [
                {"name": e.name, "start": e.time_range.start, "us": e.time_range.elapsed_us()}
                for e in prof.events()
                if e.device_type.name == "CUDA"
            ]
            prof, profiled = None, False
    return num_tokens / (time.perf_counter() - first), sorted(kernels, key=lambda k: k["start"])


def steps_of(kernels: list[dict]) -> list[tuple[list[dict], float]]:
    """Whole steps (each from its first host-to-device copy) and each one's period (us)."""
    copies = [k["name"].startswith("Memcpy HtoD") for k in kernels]
    starts = [i for i, copy in enumerate(copies) if copy and (i == 0 or not copies[i - 1])]
    return [
        (kernels[a:b], kernels[b]["start"] - kernels[a]["start"])
        for a, b in zip(starts, starts[1:], strict=False)
    ]


def exposed_times(step: list[dict]) -> list[float]:
    """Each kernel's share of the step's critical path (us): how far its end passes the latest
    end before it. Under PDL a kernel starts while the one before runs and waits inside, so its
    own duration counts that wait; its exposed time is what it adds to the step."""
    exposed, latest = [], step[0]["start"]
    for k in step:
        end = k["start"] + k["us"]
        exposed.append(max(0.0, end - latest))
        latest = max(latest, end)
    return exposed


def report(
    folder: str,
    use_pdl: bool = False,
    by_kernel: bool = False,
    use_triton_gemv: bool = False,
    max_seq_len: int = 4096,
    quantization: str | None = None,
    device_memory_limit_gib: float | None = None,
) -> None:
    config = EngineConfig(
        model=folder, device="cuda", dtype="bfloat16", max_batch_size=1, max_seq_len=max_seq_len,
        use_chunked_prefill=True, use_cuda_graphs=True, async_scheduling=True, use_pdl=use_pdl,
        use_triton_gemv=use_triton_gemv, quantization=quantization,
        device_memory_limit_gib=device_memory_limit_gib,
    )  # fmt: skip
    engine = Engine(config)
    decode(engine, profiled=False)  # warm-up
    tok_per_s, _ = decode(engine, profiled=False)
    _, kernels = decode(engine, profiled=True)
    core = engine.core
    roofline = decode_roofline(engine, PROMPT_TOKENS, NEW_TOKENS)
    bandwidth, mean_bytes = roofline["copy_bandwidth_bytes_per_s"], roofline["bytes_per_decode_token"]
    steps = steps_of(kernels)
    period = statistics.median(p for _, p in steps)
    busy = statistics.median(sum(k["us"] for k in step) for step, _ in steps)
    by_kind = defaultdict(float)
    for step, _ in steps:
        for k in step:
            by_kind[kind_of(k["name"])] += k["us"] / len(steps)
    model = core.loaded.model
    percent = 100 * tok_per_s * mean_bytes / bandwidth
    print(
        f"\n## {folder}: {tok_per_s:.0f} tok/s = {percent:.1f}% of the memory roofline "
        f"({mean_bytes / 1e6:.0f} MB a token, copy bandwidth {bandwidth / 1e9:.0f} GB/s)\n"
    )
    print(
        f"profiled step: period {period:.0f} us, kernels {busy:.0f} us, gaps {period - busy:.0f} us "
        f"({len(steps[0][0])} kernels a step); reading the bytes at the copy bandwidth: "
        f"{mean_bytes / bandwidth * 1e6:.0f} us\n"
    )
    print("| kind | us a step | % of kernel time |\n|---|---:|---:|")
    for kind, us in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"| {kind} | {us:.1f} | {100 * us / busy:.1f} |")
    if by_kernel:
        per_name = defaultdict(lambda: [0, 0.0, 0.0])
        for step, _ in steps:
            for k, exposed in zip(step, exposed_times(step), strict=True):
                per_name[k["name"]][0] += 1 / len(steps)
                per_name[k["name"]][1] += k["us"] / len(steps)
                per_name[k["name"]][2] += exposed / len(steps)
        print(
            "\n| kernel | calls a step | us a step | us a call | exposed us a step | exposed us a call |"
            "\n|---|---:|---:|---:|---:|---:|"
        )
        for name, (calls, us, exposed) in sorted(per_name.items(), key=lambda item: -item[1][2]):
            times = f"{us:.1f} | {us / calls:.2f} | {exposed:.1f} | {exposed / calls:.2f}"
            print(f"| {name[:70]} | {calls:.0f} | {times} |")
        # About one layer in the middle of a step (the step's kernels over its layers, from the
        # middle one's share on; the embedding's kernels come first, so the slice is shifted by a
        # few), kernel by kernel: where each starts and ends against the step's start, and what
        # it adds to the critical path.
        step, _ = steps[len(steps) // 2]
        per_layer = len(step) // model.config.num_layers
        middle = (model.config.num_layers // 2) * per_layer
        origin = step[0]["start"]
        print("\n| kernel (a middle layer) | start us | end us | exposed us |\n|---|---:|---:|---:|")
        exposed = exposed_times(step)
        for k, e in list(zip(step, exposed, strict=True))[middle : middle + per_layer + 2]:
            start = k["start"] - origin
            print(f"| {k['name'][:60]} | {start:.1f} | {start + k['us']:.1f} | {e:.2f} |")
    # GEMVs in order: each layer's four projections, then the LM head (a split-K GEMV's reduce
    # kernel counts with it).
    num_layers = model.config.num_layers
    times = defaultdict(list)
    for step, _ in steps:
        gemvs = []
        for k in step:
            if is_matmul(k["name"]):
                gemvs.append(k["us"])
            elif is_split_k_sum(k["name"]):
                gemvs[-1] += k["us"]
        for i, name in enumerate(PROJECTIONS):
            times[name].append(sum(gemvs[i : 4 * num_layers : 4]) / num_layers)
        times["lm_head"].append(gemvs[-1])
    layer = model.layers[0]
    linears = {
        "qkv_proj": layer.self_attn.qkv_proj,
        "o_proj": layer.self_attn.o_proj,
        "gate_up_proj": layer.mlp.gate_up_proj,
        "down_proj": layer.mlp.down_proj,
        "lm_head": model.lm_head,
    }
    print("\n| GEMV | [out, in] | MB read | us | % of copy bandwidth |\n|---|---|---:|---:|---:|")
    for name, linear in linears.items():
        us = statistics.median(times[name])
        # Every tensor the Linear holds: a quantized one's packed weight with its scales.
        nbytes = sum(t.numel() * t.element_size() for t in linear.state_dict().values())
        shape = [linear.out_features, linear.in_features]
        percent = 100 * nbytes / (us * 1e-6) / bandwidth
        print(f"| {name} | {shape} | {nbytes / 1e6:.1f} | {us:.1f} | {percent:.0f} |")
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--use-pdl", action="store_true", help="EngineConfig.use_pdl")
    parser.add_argument("--use-triton-gemv", action="store_true", help="EngineConfig.use_triton_gemv")
    parser.add_argument("--by-kernel", action="store_true", help="also each kernel's calls and time a step")
    parser.add_argument(
        "--max-seq-len", type=int, default=4096, help="EngineConfig.max_seq_len (the bench's default)"
    )
    parser.add_argument("--quantization", help="EngineConfig.quantization (int4, int8, fp8 at load)")
    parser.add_argument("--device-memory-limit-gib", type=float, help="EngineConfig.device_memory_limit_gib")
    args = parser.parse_args()
    for folder in args.checkpoints:
        report(
            folder, args.use_pdl, args.by_kernel, args.use_triton_gemv, args.max_seq_len,
            args.quantization, args.device_memory_limit_gib,
        )  # fmt: skip


if __name__ == "__main__":
    main()
