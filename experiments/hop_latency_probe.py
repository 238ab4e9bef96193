"""What one dependent step costs at batch 1: a kernel boundary under PDL, or a grid barrier inside
one persistent kernel (issue 15)? Needs a CUDA GPU of compute capability 9.0 or newer.

A batch-1 decode step of a 1B model is a chain of a few hundred kernels, each needing all of the
one before's output (attention all of q|k|v, o_proj all of attention, the next norm all of
o_proj). On an H200, Gemma 3 1B's eight kernels a layer leave 8.7 of its 27.4 µs to the four
that read next to nothing (H200, 2026-11-28, 5cf5040). Whether a kernel per layer
(grid-wide barriers between its phases instead of kernel boundaries) could pay depends first on
what a hop costs each way. Both chains here do the same work a hop: every program reads one
value another program wrote in the hop before, and writes one.
- `pdl`: one small kernel a hop, launched with `pdl=True` (each releases the next
  at its start, then waits), and `plain` (the same kernels without PDL), replayed from a graph.
- `barrier`: one kernel whose programs (at most a few per SM, so all are resident) meet at a
  barrier between hops: a release add on a global counter, then acquire loads of it until every
  program has arrived.
A hop's cost is the difference of two chain lengths over the difference of their hops, so the
launch of the graph and the counter's reset cancel. Each chain is one graph, timed by the median
of its replays (`streamed_us`); each result is checked against torch.

    PYTHONPATH=kernels-bench python experiments/hop_latency_probe.py [--reps 20]
"""

import argparse

import torch
import triton
import triton.language as tl
from sweep_quantized_gemv import streamed_us

from infer.kernels.pdl import await_inputs, launch_options

SHORT, LONG = 64, 256  # hops of the two chains a cost is measured between


@triton.jit
def _hop_kernel(src_ptr, dst_ptr, n, PDL: tl.constexpr):
    program = tl.program_id(0)
    await_inputs(PDL)
    value = tl.load(src_ptr + (program + 1) % n)
    tl.store(dst_ptr + program, value + 1)


@triton.jit
def _arrive_and_wait(counter_ptr, target):
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _barrier_chain_kernel(buffers_ptr, counter_ptr, n, hops):
    program = tl.program_id(0)
    for hop in range(hops):
        src = buffers_ptr + (hop % 2) * n
        dst = buffers_ptr + ((hop + 1) % 2) * n
        value = tl.load(src + (program + 1) % n)
        tl.store(dst + program, value + 1)
        _arrive_and_wait(counter_ptr, (hop + 1) * n)


def expected(start: torch.Tensor, hops: int) -> torch.Tensor:
    value = start
    for _ in range(hops):
        value = torch.roll(value, -1) + 1
    return value


def kernel_chain_us(programs: int, hops: int, pdl: bool, reps: int) -> float:
    start = torch.arange(programs, device="cuda", dtype=torch.int32)
    buffers = [start.clone(), torch.empty_like(start)]

    def body():
        buffers[0].copy_(start)
        for hop in range(hops):
            src, dst = buffers[hop % 2], buffers[(hop + 1) % 2]
            _hop_kernel[(programs,)](src, dst, programs, **launch_options(start, pdl))

    time = streamed_us([body], repeats=reps)  # a captured launch keeps its launch mode
    assert torch.equal(buffers[hops % 2], expected(start, hops)), "the kernel chain computed a wrong value"
    return time


def barrier_chain_us(programs: int, hops: int, reps: int) -> float:
    start = torch.arange(programs, device="cuda", dtype=torch.int32)
    buffers = torch.empty(2, programs, device="cuda", dtype=torch.int32)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)

    def body():
        buffers[0].copy_(start)
        counter.zero_()
        _barrier_chain_kernel[(programs,)](buffers, counter, programs, hops, num_warps=4)

    time = streamed_us([body], repeats=reps)
    assert torch.equal(buffers[hops % 2], expected(start, hops)), "the barrier chain computed a wrong value"
    return time


def per_hop_us(chain_us, **kwargs) -> float:
    return (chain_us(hops=LONG, **kwargs) - chain_us(hops=SHORT, **kwargs)) / (LONG - SHORT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    reps = parser.parse_args().reps
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}"
    )
    print("| programs | plain kernels | PDL kernels | grid barrier |\n|---:|---:|---:|---:|")
    for programs in (16, sms, 2 * sms, 4 * sms):
        plain = per_hop_us(kernel_chain_us, programs=programs, pdl=False, reps=reps)
        pdl = per_hop_us(kernel_chain_us, programs=programs, pdl=True, reps=reps)
        barrier = per_hop_us(barrier_chain_us, programs=programs, reps=reps)
        print(f"| {programs} | {plain:.2f} | {pdl:.2f} | {barrier:.2f} |", flush=True)


if __name__ == "__main__":
    main()
