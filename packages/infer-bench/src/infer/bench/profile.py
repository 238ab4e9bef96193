"""`infer profile`: a short greedy generation under torch.profiler.

Writes a Chrome trace (open in chrome://tracing or https://ui.perfetto.dev) and prints the top
ops by self time: CUDA kernels on a GPU, CPU ops otherwise. On CUDA it also prints how much of
each decode step is CPU launch overhead: the step's wall time minus the time the GPU was busy
with kernels launched in it. A decode step of a small model is mostly launch overhead; that
share is what CUDA graphs remove.

Each `next()` on the generation stream runs exactly one step (prefill + first sample, then one
decode forward + sample each), and each step ends by reading its token on the host, which waits
for the GPU; so every kernel of a step lies inside that step's `record_function` range.
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from infer.bench.generation import random_prompt
from infer.engine import load_engine
from infer.engine.cli import engine_config_from_args
from infer.engine.generate import generate, stream
from infer.engine.sampling_params import SamplingParams

DECODE_STEP = "infer.decode_step"
PREFILL = "infer.prefill"


def run_profile(args: argparse.Namespace) -> int:
    loaded, engine = load_engine(engine_config_from_args(args))
    on_cuda = engine.core.device.type == "cuda"
    prompt_ids = random_prompt(loaded, args.prompt_tokens, seed=0)
    params = SamplingParams(temperature=0, max_new_tokens=args.gen_tokens, ignore_eos=True)
    generate(engine, prompt_ids, params)  # warm-up, outside the trace

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        chunks = stream(engine, prompt_ids, params)
        with record_function(PREFILL):
            next(chunks)
        while True:
            with record_function(DECODE_STEP):
                chunk = next(chunks, None)
            if chunk is None or chunk.finished:
                break

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / "trace.json"
    prof.export_chrome_trace(str(trace_path))
    sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    print(
        f"{'CUDA kernels' if on_cuda else 'CPU ops'} by self time: {len(prompt_ids)} prompt tokens, "
        f"{args.gen_tokens} generated, {loaded.path}, {next(loaded.model.parameters()).dtype}, "
        f"{'CUDA graphs' if engine.config.use_cuda_graphs else 'eager'}, torch {torch.__version__}"
    )
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.row_limit))
    if on_cuda:
        print(launch_overhead_summary(prof.events()))
    print(f"Chrome trace: {trace_path}", file=sys.stderr)
    return 0


def launch_overhead_summary(events) -> str:
    steps = [e for e in events if e.name == DECODE_STEP and e.device_type == DeviceType.CPU]
    # Device-side events: kernels, memcpy, memset; not the GPU copies of our own annotations.
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA and e.name not in (DECODE_STEP, PREFILL)
    )
    if not steps:
        return "no decode steps were recorded"
    shares, wall_us, busy_us = [], 0.0, 0.0
    for step in steps:
        start, end = step.time_range.start, step.time_range.end
        busy = _union_length([(max(s, start), min(e, end)) for s, e in kernels if s < end and e > start])
        wall = end - start
        wall_us += wall
        busy_us += busy
        shares.append(1 - busy / wall if wall > 0 else 0.0)
    shares.sort()
    return (
        f"decode steps: {len(steps)}, mean wall {wall_us / len(steps):.1f} us, mean GPU busy "
        f"{busy_us / len(steps):.1f} us; CPU launch overhead (wall - GPU busy) {1 - busy_us / wall_us:.1%} "
        f"of decode time (per step: median {shares[len(shares) // 2]:.1%}, min {shares[0]:.1%}, "
        f"max {shares[-1]:.1%})"
    )


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total
