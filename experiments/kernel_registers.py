"""Registers and spills of every Triton kernel a batch-1 decode compiled, as its JIT compiled it.

A kernel compiled offline (`triton.compile` of an `ASTSource`) without the argument
specialization the JIT gives (integers divisible by 16, pointers aligned to 16 bytes) loads 2
bytes at a time where the JIT's loads 16, and needs far more registers: the gated GEMV's
8 x 256 tiles compiled to 255 registers and 72 bytes of spill that way, 129 and none with the
hints (2026-11-28, 8e22133). This reads what the GPU runs. Each checkpoint decodes a few tokens
through the engine (CUDA graphs, PDL, the Triton GEMV), then every compiled variant of every kernel in
`infer.kernels` is printed with its registers a thread, spilled bytes, warps, and by the
register count the programs that fit an SM. Needs a CUDA GPU.

    python experiments/kernel_registers.py /tmp/ckpt/gemma-3-1b ...
"""

import argparse
import importlib
import pkgutil

import torch
from triton.runtime.jit import JITFunction

import infer.kernels
from infer.engine import Engine, EngineConfig, SamplingParams

# An SM's registers, the allocation unit (registers a thread, per warp) and the most programs
# an SM holds: H100/H200 (sm_90).
SM_REGISTERS, REGISTER_UNIT, MAX_PROGRAMS = 65536, 8, 32


def jit_functions() -> dict[str, JITFunction]:
    found = {}
    for info in pkgutil.iter_modules(infer.kernels.__path__, "infer.kernels."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(getattr(value, "fn", None), JITFunction):  # an autotuner's kernel
                value = value.fn
            if isinstance(value, JITFunction) and value.fn.__module__ == info.name:  # defined here
                found[f"{info.name.rsplit('.', 1)[1]}.{name}"] = value
    return found


def compiled_variants(fn: JITFunction):
    """(specialization key, compiled kernel) of each variant the JIT built, on every device."""
    for cache in fn.device_caches.values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        yield from kernels.items()


def constexprs(kernel) -> str:
    """The compiled variant's constexpr arguments (`NAME=value`), from the source the JIT kept."""
    src = getattr(kernel, "src", None)
    fn, constants = getattr(src, "fn", None), getattr(src, "constants", None)
    if fn is None or not constants:
        return ""
    marked = {p.name for p in fn.params if p.is_constexpr}
    named = ((fn.arg_names[index[0]], value) for index, value in constants.items() if len(index) == 1)
    return " ".join(f"{name}={value}" for name, value in named if name in marked)


def programs_an_sm(registers: int, warps: int) -> int:
    per_warp = -(-registers // REGISTER_UNIT) * REGISTER_UNIT * 32
    return min(MAX_PROGRAMS, SM_REGISTERS // (per_warp * warps), 64 // warps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoints", nargs="+")
    args = parser.parse_args()
    for folder in args.checkpoints:
        config = EngineConfig(
            model=folder, device="cuda", dtype="bfloat16", max_batch_size=1, max_seq_len=4096,
            use_cuda_graphs=True, async_scheduling=True, use_pdl=True, use_triton_gemv=True,
        )  # fmt: skip
        engine = Engine(config)
        engine.add_request(
            list(range(100, 356)), SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        )
        while engine.has_work():
            engine.step()
        torch.cuda.synchronize()
        del engine
    print("| kernel | registers | spilled bytes | warps | programs an SM | constexprs |")
    print("|---|---:|---:|---:|---:|---|")
    for name, fn in sorted(jit_functions().items()):
        for key, kernel in compiled_variants(fn):
            kernel._init_handles()
            warps = kernel.metadata.num_warps
            print(
                f"| {name} | {kernel.n_regs} | {kernel.n_spills} | {warps} | "
                f"{programs_an_sm(kernel.n_regs, warps)} | {constexprs(kernel) or str(key)[:160]} |"
            )


if __name__ == "__main__":
    main()
