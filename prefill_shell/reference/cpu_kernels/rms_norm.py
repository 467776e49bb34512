"""RMSNorm of float32 or bfloat16 rows in one pass on the CPU (``rms_norm.c``), with transformers' roundings.

transformers normalises a row in float32, rounds it to the model dtype, then
multiplies by the weight in that dtype; torch runs that as five or six passes
over the rows (a float32 copy at bfloat16, the square, the mean, the scale, the
rounding, the weight). The kernel reads each row once and writes it once.
``rms_norm_rows`` is None where it does not apply (another dtype, a per-head
weight, a CUDA tensor, a CPU the kernels do not run on), and the caller keeps
torch's ops.
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

__all__ = ["NORM_ROWS", "rms_norm_rows"]

NORM_ROWS = 32
"""Rows a thread claims at a time (``ROWS`` in ``rms_norm.c``): one work item."""


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``[N, C]`` rows normalised and scaled by ``weight [C]`` (same dtype) as a new ``[N, C]`` tensor, or None."""
    if (
        x.dtype not in kernel_dtypes()
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.stride(1) != 1
        or weight.shape != (x.shape[1],)
        or weight.dtype != x.dtype
        or not weight.is_contiguous()
    ):
        return None
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=x.dtype)
    args = NormArgs(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, cols, eps, 0)
    threads = threads_for(-(-rows // NORM_ROWS), rows * cols >= SHARED_ELEMENTS)
    bf16 = int(x.dtype == torch.bfloat16)
    run_kernel("prefill::rms_norm", kernel_library().rms_norm_rows, ctypes.byref(args), bf16, threads)
    return out
