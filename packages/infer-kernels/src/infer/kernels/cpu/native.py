"""C kernels for the CPU, built on first use with the system's C compiler and loaded with ctypes,
as Triton builds its launchers: no compiled code in the wheel, one build per machine.

Five use them: `int8_linear_cpu` (int8 weights times a few rows), `bf16_linear_cpu` (bf16
weights times a few rows), `gguf_linear_cpu` (GGUF's Q4_0, Q4_1 and Q8_0 blocks times rows),
`paged_attention_cpu` (decode rows) and `DecoderStackCpu` (a model's blocks for a step of decode
rows, which includes the other four sources). The first four take a `native` argument and take
their ATen path with `native=False` (a model built with
`KernelPolicy(use_native_cpu_kernels=False)`, EngineConfig.use_native_cpu_kernels) or where the
library cannot be built; the engine's runner selects `paged_attention_cpu` only where its policy
allows it.

`load_native(source)` compiles `source` (a .c file beside this module) into a shared library
under `$INFER_HOME/kernels` (INFER_HOME defaults to ~/.cache/infer), named by a hash of every
source of this package (one may include another), the flags and the compiler's version, so that an
edit or another compiler builds anew.
It returns None, having logged why once, where that cannot be done: not x86-64 with AVX2, no C
compiler (`$CC`, else `cc`), or a failed build. Callers then take an ATen path.

Every library is built for AVX2 (FLAGS); code for wider units is compiled inside it under a
`#pragma GCC target` and chosen at run time by what the CPU reports (gguf_gemv_cpu.c's AVX-512
VNNI one-row product, in gguf_gemv_avx512.c), so one build serves every x86-64 CPU with AVX2.

The library links the OpenMP runtime by its soname, libgomp.so.1, which resolves to the one
torch has already loaded: one thread pool in the process, sized by `torch.get_num_threads()`.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# F16C (the GGUF blocks' fp16 scales) comes with AVX2 on every x86 CPU that has it.
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")
LIBRARIES = ("-lm",)

SOURCES = (
    "int8_gemv_cpu.c",
    "bf16_gemv_cpu.c",
    "gguf_gemv_cpu.c",
    "decode_attention_cpu.c",
    "decoder_stack_cpu.c",
)


def native_cpu_kernels_available() -> bool:
    """Whether every C kernel builds and loads here (building them now, once a machine)."""
    return all(load_native(source) is not None for source in SOURCES)


def cache_dir() -> Path:
    home = os.environ.get("INFER_HOME") or Path.home() / ".cache" / "infer"
    return Path(home).expanduser() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _unsupported_reason() -> str | None:
    if os.environ.get("INFER_KERNELS_BACKEND") == "torch":
        return "INFER_KERNELS_BACKEND=torch asks for the references"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"built for x86-64 Linux only, not {platform.system()} {platform.machine()}"
    # torch's AVX2 level implies FMA too.
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if _compiler() is None:
        return "no C compiler ($CC, cc or gcc) on the PATH"
    return None


# What the kernels' entry points take besides ints and floats: a tensor's data, and a size.
POINTER, SIZE = ctypes.c_void_p, ctypes.c_int64


def native_function(source: str, name: str, argtypes: Sequence) -> Callable[..., int] | None:
    """Entry point `name` of the library built from `source` (`load_native`), declared to take
    `argtypes` and to return a C int (0: done); None where the library cannot be built here."""
    library = load_native(source)
    if library is None:
        return None
    function = getattr(library, name)
    if function.argtypes is None:
        function.argtypes = list(argtypes)
        function.restype = ctypes.c_int
    return function


@functools.cache
def load_native(source: str) -> ctypes.CDLL | None:
    """The shared library built from `source`, a .c file of this package; None where it cannot be
    built here (the reason logged once)."""
    reason = _unsupported_reason()
    if reason is None:
        try:
            return ctypes.CDLL(str(_build(Path(__file__).with_name(source))))
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or error
            reason = f"building it failed: {str(detail).strip()[-2000:]}"
    logger.warning("infer.kernels: %s is not used, %s; its ATen fallback runs instead", source, reason)
    return None


def _build(source: Path) -> Path:
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [path.read_text() for path in sorted(source.parent.glob("*.c"))]
    key = hashlib.sha256("\0".join([source.name, *texts, *FLAGS, *LIBRARIES, version]).encode()).hexdigest()
    target = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if not target.exists():
        logger.info("building %s with %s (once per machine and compiler) ...", source.name, compiler)
        started_s = time.perf_counter()
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place, so that processes building at once
        # (pytest workers) never load a half-written file.
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *FLAGS, str(source), "-o", str(built), *LIBRARIES]
            subprocess.run(command, capture_output=True, text=True, check=True)
            os.replace(built, target)
        logger.info("building %s: %.1f s", source.name, time.perf_counter() - started_s)
    return target
