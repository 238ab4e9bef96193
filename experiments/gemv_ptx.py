"""The PTX of the GEMV kernels (`_gemv_kernel`, `_dense_gemv_kernel`) for a few configurations,
compiled for an H100 (sm_90) without a GPU, debug sections left out: to tell whether a change to
the kernels' source changes the code a configuration compiles to. Run it once per source tree
and compare the two files:

    PYTHONPATH=<old tree's package srcs> python experiments/gemv_ptx.py /tmp/old.json
    PYTHONPATH=<new tree's package srcs> python experiments/gemv_ptx.py /tmp/new.json
    python experiments/gemv_ptx.py --compare /tmp/old.json /tmp/new.json

Constexprs a tree's kernel does not have are left out, so trees that add one can be compared
(its value here is the one that keeps the old code path).
"""

import argparse
import collections
import importlib
import json
import re
from pathlib import Path

# Each case: the weight's pointer type, the tile and warps, and the kernel's constexpr flags.
_DENSE = dict(SCALED=False, SCALE_PER_TILE=False, SCALE_ON_X=False, WEIGHT_FP8=False, FAST_INT8=False)
CASES = {
    "bf16 gemv (4 x 1024, 8 warps)": ("*bf16", 8, _DENSE | dict(GATED=False, BLOCK_N=4, BLOCK_K=1024)),
    "bf16 gated gemv (8 x 256, 2 warps)": ("*bf16", 2, _DENSE | dict(GATED=True, BLOCK_N=8, BLOCK_K=256)),
    "int8 per channel (16 x 512, 8 warps)": (
        "*i8",
        8,
        _DENSE | dict(SCALED=True, FAST_INT8=True, GATED=False, BLOCK_N=16, BLOCK_K=512),
    ),
}
# Flags every case shares, and the values of flags only some trees have.
COMMON = dict(HAS_BIAS=False, GELU_TANH=False, UNROLL=1, PDL=True, X_SCALE_PER_COLUMN=False, FOLD=1)


def ptx_code(ptx: str) -> list[str]:
    """The instructions and declarations, without debug sections, comments or line markers."""
    code = []
    for line in ptx.splitlines():
        line = re.sub(r"\s+", " ", line.split("//")[0]).strip()
        # Parameter declarations and loads, and the kernel's name, are left out: a kernel given
        # new arguments (read only by a path a case does not compile), or fewer (the dense GEMV's
        # entry), is the same code.
        skipped = (".loc", ".file", ".b8", ".b32", ".b64", ".section", "$L__", ".param", "ld.param")
        skipped += (".visible",)
        if line and not line.startswith(skipped):
            code.append(line)
    return code


def gemv_kernel(scaled: bool):
    """The tree's GEMV for a case: the 8-bit or the dense kernel where they are two, else the one."""
    try:
        from infer.kernels.gemv import streaming
    except ImportError:  # a tree from before the kernels moved into infer.kernels.gemv (8075def)
        # By name: the module exists only in those trees (tests/test_script_imports reads this
        # file's `from infer... import` lines against this tree).
        return importlib.import_module("infer.kernels.quantized_linear")._gemv_kernel
    return streaming._gemv_kernel if scaled else streaming._dense_gemv_kernel


def compile_cases() -> dict[str, list[str]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for name, (weight_type, num_warps, flags) in CASES.items():
        flags = COMMON | flags
        kernel = gemv_kernel(flags["SCALED"])
        signature, constexprs = {}, {}
        for param in kernel.params:
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[(kernel.arg_names.index(param.name),)] = flags[param.name]
            elif param.name == "w_ptr" or (param.name == "scale_ptr" and not flags["SCALED"]):
                signature[param.name] = weight_type
            elif param.name == "scale_ptr":
                signature[param.name] = "*fp32"
            else:
                signature[param.name] = "*bf16" if param.name.endswith("_ptr") else "i32"
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        options = {"num_warps": num_warps, "num_stages": 1}
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        out[name] = ptx_code(compiled.asm["ptx"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path, help="where to write the PTX, or two files to compare")
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args()
    if not args.compare:
        args.files[0].write_text(json.dumps(compile_cases(), indent=1))
        return
    old, new = (json.loads(path.read_text()) for path in args.files)
    for name in old:
        if old[name] == new.get(name):
            verdict = "same PTX"
        elif instructions(old[name]) == instructions(new.get(name, [])):
            verdict = "the same instructions, in another order or registers"
        else:
            verdict = "DIFFERENT PTX"
        print(f"{name}: {verdict} ({len(old[name])} and {len(new.get(name, []))} lines)")


def instructions(code: list[str]) -> collections.Counter:
    """The code's lines with every register named alike, counted: equal for two kernels whose
    instructions differ only in their order and their registers' numbers."""
    return collections.Counter(re.sub(r"%[a-z]+[0-9]+", "%r", line) for line in code)


if __name__ == "__main__":
    main()
