"""Shared measuring for the kernel benchmarks: cases, CUDA-event timing, copy bandwidth, tables.

Every op is timed three ways on the same inputs: the Triton kernel (the public op), PyTorch
eager (the op's `*_ref`, the composition a model would run without us) and torch.compile of
that same reference. Time is the median of `triton.testing.do_bench` (CUDA events, L2 flushed
between runs), so decode figures are kernel time, not Python launch overhead. Achieved GB/s is
the bytes the op must read and write divided by the Triton time, and is compared with the
device's own device-to-device copy bandwidth measured once in the same process.
"""

import datetime
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.testing

DECODE_TOKENS = [1, 16, 256]
PREFILL_TOKENS = [2048, 8192, 16384]
# (hidden, intermediate) of Llama 3.2 1B, Llama 3.2 3B and Llama 3.1 8B.
MODEL_SIZES = [(2048, 8192), (3072, 8192), (4096, 14336)]
DTYPE = torch.bfloat16
IMPLS = ("triton", "eager", "compile")


@dataclass
class Case:
    op: str
    shape: str
    tokens: int
    bytes_moved: int  # what the op must read + write, at the minimum
    make_inputs: Callable[[], tuple]  # fresh inputs on the GPU, built only when the case runs
    triton_fn: Callable
    eager_fn: Callable
    result: dict = field(default_factory=dict)

    @property
    def phase(self) -> str:
        return "decode" if self.tokens <= 256 else "prefill"

    @property
    def id(self) -> str:
        return f"{self.op}-{self.shape.replace(' ', '-')}"


def _raise_recompile_limits() -> None:
    # Each case is a new static shape of the same function; past dynamo's default limit (8)
    # torch.compile silently falls back to eager, which would make the comparison a lie.
    for name in (
        "cache_size_limit",
        "recompile_limit",
        "accumulated_cache_size_limit",
        "accumulated_recompile_limit",
    ):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 100_000)


def impl_fn(case: Case, impl: str) -> Callable:
    if impl == "triton":
        return case.triton_fn
    if impl == "eager":
        return case.eager_fn
    _raise_recompile_limits()
    return torch.compile(case.eager_fn, dynamic=False)


def time_ms(fn: Callable, args: tuple) -> float:
    fn(*args)  # compile (Triton or inductor) outside the timed region
    torch.cuda.synchronize()
    return triton.testing.do_bench(lambda: fn(*args), warmup=10, rep=50, return_mode="median")


def graph_us(fn: Callable, args: tuple) -> float:
    """Kernel time with no CPU in the loop: the op replayed from a CUDA graph (L2 not flushed)."""
    return 1e3 * triton.testing.do_bench_cudagraph(lambda: fn(*args), rep=20, return_mode="median")


def launch_us(fn: Callable, args: tuple, calls: int = 200) -> float:
    """CPU time per call (checks + launch), the floor of an op's time when not in a CUDA graph."""
    fn(*args)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


@functools.cache
def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written over time, the ceiling for these ops."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), ())
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def record_time(case: Case, impl: str, ms: float) -> None:
    """Store one implementation's time; once all three are in, derive the bandwidth and ratios."""
    case.result[f"{impl}_us"] = ms * 1e3
    if all(f"{i}_us" in case.result for i in IMPLS):
        us = {i: case.result[f"{i}_us"] for i in IMPLS}
        gbps = case.bytes_moved / (us["triton"] * 1e-6) / 1e9
        case.result.update(
            triton_gbps=gbps,
            pct_of_copy=100 * gbps / copy_bandwidth_gbps(),
            speedup_vs_eager=us["eager"] / us["triton"],
            speedup_vs_compile=us["compile"] / us["triton"],
        )


def run_case(case: Case) -> dict:
    inputs = case.make_inputs()
    for impl in IMPLS:
        record_time(case, impl, time_ms(impl_fn(case, impl), inputs))
    case.result["triton_graph_us"] = graph_us(case.triton_fn, inputs)
    case.result["triton_launch_us"] = launch_us(case.triton_fn, inputs)
    return case.result


def environment_header() -> str:
    return (
        f"Device: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"dtype {str(DTYPE).removeprefix('torch.')} | date {datetime.date.today().isoformat()} | "
        f"measured copy bandwidth {copy_bandwidth_gbps():.0f} GB/s"
    )


def markdown_table(cases: list[Case]) -> str:
    rows = [
        "| op | shape | phase | Triton us | eager us | compile us | Triton GB/s | % of copy "
        "| x eager | x compile | Triton us, CUDA graph | Triton CPU us/call |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        r = case.result
        if "error" in r or "triton_gbps" not in r:
            rows.append(
                f"| {case.op} | {case.shape} | {case.phase} | error: {r.get('error', 'incomplete')} |||||||"
            )
            continue
        rows.append(
            f"| {case.op} | {case.shape} | {case.phase} | {r['triton_us']:.1f} | {r['eager_us']:.1f} | "
            f"{r['compile_us']:.1f} | {r['triton_gbps']:.0f} | {r['pct_of_copy']:.0f}% | "
            f"{r['speedup_vs_eager']:.2f} | {r['speedup_vs_compile']:.2f} | "
            f"{r.get('triton_graph_us', float('nan')):.1f} | {r.get('triton_launch_us', float('nan')):.1f} |"
        )
    return "\n".join(rows)


def gpu_tensor(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device="cuda")
