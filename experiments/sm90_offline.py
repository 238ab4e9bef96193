"""Compile a Triton kernel for sm_90 on a machine without a GPU: registers a thread, spilled bytes,
shared memory and SASS instruction counts, from ptxas and cuobjdump as Triton ships them.

The JIT specializes a launch's arguments: integers divisible by 16 and pointers aligned to 16
bytes are marked (`tt.divisibility`), which lets a tile's loads be 16 bytes wide. A compile
without the marks loads 2 bytes at a time and keeps an address for every element in registers:
generation.md's H200 entries of 2026-11-28 before 8e22133 reported the gated GEMV's 8 x 256
tiles at 255 registers and 72 bytes of spill that way, 129 and none with the marks. So every pointer and
integer argument is marked here, except those named in `unmarked` (give the ones a launch
passes that are not multiples of 16, and those the kernel lists in `do_not_specialize`).
`kernel_registers.py` reads what the JIT compiled on a GPU.

    python experiments/sm90_offline.py   # the decode split for Gemma's heads, as an example
"""

import collections
import importlib
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sm90_signature(
    kernel,
    constexprs: dict,
    *,
    types: dict[str, str] | None = None,
    unmarked: tuple[str, ...] = (),
    default="*bf16",
) -> tuple[dict, dict, dict]:
    """(signature, constants, attrs) of `kernel` for an `ASTSource` (Triton's or Gluon's): its
    constexprs from `constexprs`, every other argument of `types`' type (else `default`), marked
    divisible by 16 as the JIT marks them unless named in `unmarked` or a float."""
    types = types or {}
    signature, constants, attrs = {}, {}, {}
    for param in kernel.params:
        index = kernel.arg_names.index(param.name)
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constants[(index,)] = constexprs[param.name]
            continue
        signature[param.name] = types.get(param.name, default)
        if param.name not in unmarked and not signature[param.name].startswith("fp"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def compile_sm90(
    kernel,
    constexprs: dict,
    *,
    types: dict[str, str] | None = None,
    unmarked: tuple[str, ...] = (),
    num_warps: int = 4,
    num_stages: int = 1,
    maxnreg: int | None = None,
) -> dict:
    """Registers, spill (bytes of stack a thread), shared memory, the SASS instruction count and
    the ten commonest opcodes of `kernel` built for sm_90. Arguments not in `constexprs` are
    `*bf16` unless `types` says otherwise (Triton's names: "i32", "fp32", "*fp32", "*i32")."""
    signature, constants, attrs = sm90_signature(kernel, constexprs, types=types, unmarked=unmarked)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    cubin = Path("/tmp") / f"sm90_offline_{compiled.hash}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run(
        [_BIN / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True, check=True
    ).stdout
    sass = subprocess.run(
        [_BIN / "cuobjdump", "--dump-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    cubin.unlink()
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    opcodes = collections.Counter(match.group(1) for match in _INSTRUCTION.finditer(sass))
    return dict(
        registers=int(found.group(1)),
        spilled_bytes=int(found.group(2)),
        shared_bytes=int(found.group(3)),
        instructions=sum(opcodes.values()),
        commonest=opcodes.most_common(10),
    )


def main() -> None:
    module = importlib.import_module("infer.kernels.paged_attention.decode")
    kernel = module._decode_split_kernel
    types = {p.name: "i32" for p in kernel.params if "stride" in p.name}
    types.update(
        num_splits="i32", sliding_window="i32", scale="fp32", seq_len_ptr="*i32", block_table_ptr="*i32"
    )
    types.update(part_max_ptr="*fp32", part_sum_ptr="*fp32", part_acc_ptr="*fp32")
    constexprs = dict(
        GROUP=4, GROUP_PAD=16, HEAD_DIM=256, DIM_PAD=256, BLOCK_SIZE=16, BLOCK_N=32, HAS_WINDOW=True,
        SINGLE_SPLIT=False, DOT_PRECISION="tf32", PDL=True,
    )  # fmt: skip
    extra = {p.name for p in kernel.params if p.is_constexpr} - set(constexprs)
    constexprs.update({name: False for name in extra})  # switches newer than this example: off
    # Marked as the JIT marks them at Gemma's shapes, but for the kernel's do_not_specialize.
    result = compile_sm90(
        kernel,
        constexprs,
        types=types,
        unmarked=("num_splits", "block_table_stride"),
        num_warps=8,
        num_stages=2,
    )
    print("decode split, Gemma 3's heads (4 a KV head, 256 dims), 32 keys, 8 warps:", result)


if __name__ == "__main__":
    main()
