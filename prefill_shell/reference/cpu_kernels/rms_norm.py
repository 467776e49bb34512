"""RMSNorm of bfloat16 rows in one pass on the CPU (``rms_norm.c``), with transformers' roundings.

transformers normalises a bfloat16 row in float32, rounds it to bfloat16,
then multiplies by the bfloat16 weight; torch runs that as six passes over
the rows (a float32 copy, its square, the mean, the scale, the rounding, the
weight). The kernel reads each row once and writes it once. ``rms_norm_rows``
is None where it does not apply (another dtype, a per-head weight, a CUDA
tensor, a CPU without AVX512-BF16), and the caller keeps torch's ops.
"""

from __future__ import annotations

import ctypes

import torch

from prefill_shell.reference.cpu_kernels.library import (
    SHARED_ELEMENTS,
    NormArgs,
    kernel_dtypes,
    kernel_library,
    run_kernel,
    threads_for,
)

__all__ = ["rms_norm_rows"]


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``[N, C]`` bfloat16 rows normalised and scaled by ``weight [C]`` as a new ``[N, C]`` tensor, or None."""
    if (
        x.dtype != torch.bfloat16
        or torch.bfloat16 not in kernel_dtypes()
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.stride(1) != 1
        or weight.shape != (x.shape[1],)
        or weight.dtype != torch.bfloat16
        or not weight.is_contiguous()
    ):
        return None
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    args = NormArgs(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, cols, eps, 0)
    threads = threads_for(rows * cols >= SHARED_ELEMENTS)
    run_kernel("prefill::rms_norm", kernel_library().rms_norm_bf16, ctypes.byref(args), threads)
    return out
