"""The PTX of the int4 kernels (`_int4_gemv_kernel`, `_int4_dot_kernel`, `_int4_dequantize_kernel`)
and of the 8-bit tensor-core kernel (`_dot_kernel`, whose tile order the int4 one shares) for a few
configurations, compiled for sm_90 without a GPU, as gemv_ptx.py does for the 8-bit and dense
GEMVs: to tell whether a change to the kernels' source changes the code they compile to.

    PYTHONPATH=<old tree's package srcs> python experiments/int4_ptx.py /tmp/old.json
    PYTHONPATH=<new tree's package srcs> python experiments/int4_ptx.py /tmp/new.json
    python experiments/gemv_ptx.py --compare /tmp/old.json /tmp/new.json
"""

import importlib
import json
import sys

import triton
from gemv_ptx import ptx_code
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_GEMV = dict(HAS_BIAS=False, GATED=False, GELU_TANH=False, PDL=True, PREFETCH=0)
# Each case: the kernel, its warps, its constexprs.
CASES = {
    "gemv 64 x 128, bf16 x, zero points": (
        "_int4_gemv_kernel",
        4,
        _GEMV
        | dict(
            GROUP_SIZE=128,
            HAS_ZEROS=True,
            BLOCK_N=64,
            BLOCK_K=128,
            GROUPS=1,
            UNROLL=4,
            PRMT=True,
            EXACT=False,
        ),
    ),
    "gemv 16 x 512 of 4 groups, gated, bias": (
        "_int4_gemv_kernel",
        8,
        _GEMV
        | dict(
            GROUP_SIZE=128,
            HAS_ZEROS=False,
            HAS_BIAS=True,
            BLOCK_N=16,
            BLOCK_K=512,
            GROUPS=4,
            UNROLL=1,
            PRMT=True,
            EXACT=False,
            GATED=True,
        ),
    ),  # fmt: skip
    "gemv 32 x 64, fp32 x (exact)": (
        "_int4_gemv_kernel",
        4,
        _GEMV
        | dict(
            GROUP_SIZE=64,
            HAS_ZEROS=True,
            BLOCK_N=32,
            BLOCK_K=64,
            GROUPS=1,
            UNROLL=1,
            PRMT=False,
            EXACT=True,
            PDL=False,
        ),
    ),  # fmt: skip
    "dot 16 x 64 x 64": (
        "_int4_dot_kernel",
        4,
        dict(
            GROUP_SIZE=128,
            HAS_ZEROS=True,
            HAS_BIAS=False,
            PRMT=True,
            NATIVE_DOT=True,
            BLOCK_M=16,
            BLOCK_N=64,
            BLOCK_K=64,
            GROUP_N=8,
            PDL=True,
        ),
    ),  # fmt: skip
    "dequantize 32 x 128": (
        "_int4_dequantize_kernel",
        4,
        dict(GROUP_SIZE=128, HAS_ZEROS=True, BLOCK_N=32, BLOCK_K=128, PDL=False),
    ),
    "8-bit dot, int8, 16 x 64 x 128": (
        "_dot_kernel",
        4,
        dict(
            SCALE_PER_TILE=False,
            HAS_BIAS=False,
            WEIGHT_FP8=False,
            FAST_INT8=True,
            NATIVE_DOT=True,
            BLOCK_M=16,
            BLOCK_N=64,
            BLOCK_K=128,
            GROUP_N=8,
            PDL=True,
        ),
    ),  # fmt: skip
}
# Constexprs of newer trees than the cases, at the values that keep the older code path.
NEWER = {"SPLITS": 0}
# Where each kernel may live, newest first.
MODULES = ("infer.kernels.gemv.int4_gemv", "infer.kernels.gemv.int4", "infer.kernels.gemv.quantized")


def kernel(name: str):
    """The tree's kernel: the one-row GEMV in gemv.int4_gemv, or in gemv.int4 in trees before it
    moved there."""
    for module in MODULES:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise LookupError(name)


def compile_cases() -> dict[str, list[str]]:
    out = {}
    for case, (name, num_warps, flags) in CASES.items():
        fn = kernel(name)
        signature, constexprs = {}, {}
        for param in fn.params:
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[(fn.arg_names.index(param.name),)] = flags.get(param.name, NEWER.get(param.name))
            elif param.name == "w_ptr":
                signature[param.name] = "*i8" if name == "_dot_kernel" else "*i32"
            elif param.name == "scale_ptr" and name == "_dot_kernel":
                signature[param.name] = "*fp32"
            elif param.name == "count_ptr":
                signature[param.name] = "*i32"
            elif param.name.endswith("_ptr"):
                signature[param.name] = "*fp32" if flags.get("EXACT") and param.name == "x_ptr" else "*bf16"
            else:
                signature[param.name] = "i32"
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        options = {"num_warps": num_warps, "num_stages": 1}
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        out[case] = ptx_code(compiled.asm["ptx"])
    return out


if __name__ == "__main__":
    with open(sys.argv[1], "w") as out:
        json.dump(compile_cases(), out, indent=1)
