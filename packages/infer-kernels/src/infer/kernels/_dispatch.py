"""Chooses between the Triton kernel and the PyTorch reference for one call.

CUDA tensors take the Triton path. CPU tensors take the reference, unless
`INFER_KERNELS_BACKEND=triton` is set together with `TRITON_INTERPRET=1`, which is how the
tests run the Triton code itself on a machine without a GPU. `INFER_KERNELS_BACKEND=torch`
forces the reference everywhere (useful to bisect a numerical difference).
"""

import functools
import os

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# SMs assumed where there is no CUDA device (the interpreter): an H100's.
_DEFAULT_SMS = 132


def use_triton(x: torch.Tensor) -> bool:
    backend = os.environ.get("INFER_KERNELS_BACKEND", "auto")
    if backend == "torch":
        return False
    if backend == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "INFER_KERNELS_BACKEND=triton on a CPU tensor needs TRITON_INTERPRET=1 (set before "
                "infer.kernels is imported); unset INFER_KERNELS_BACKEND to use the PyTorch reference"
            )
        return True
    if backend != "auto":
        raise ValueError(f"INFER_KERNELS_BACKEND must be auto, torch or triton, got {backend!r}")
    return x.is_cuda


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def num_sms(device: torch.device) -> int:
    """The SMs of `device` (a CUDA GPU's, else _DEFAULT_SMS), for grids sized to a wave."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return _DEFAULT_SMS


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
