"""What a torch device computes natively, probed once per process: the facts ``prefill_core.values.dtype`` decides on.

On a CPU: torch's dispatch capability (``torch.backends.cpu.
get_cpu_capability()``, which stops at "AVX512" and cannot tell AMX), the
bfloat16 matrix instructions torch reports (``torch.cpu.
_is_amx_tile_supported()``, ``_is_avx512_bf16_supported()``), and, where
either is present, a short ``torch.mm`` probe per dtype: an instruction set
reported but not reached by this torch build shows up as a slow probe, and
the core then keeps float32. On CUDA: the device name and
``torch.cuda.is_bf16_supported()``.
"""

from __future__ import annotations

import functools
import time

import torch

from prefill_core.values.dtype import DTYPES, DeviceNumerics, DtypeChoice, canonical_dtype, resolve_dtype
from prefill_core.values.errors import InvalidDtypeError

__all__ = ["choose_dtype", "matmul_gflops", "probe_numerics", "torch_dtype"]

_PROBE_SHAPE = (256, 512, 1024)  # rows x inner x out: a small model's MLP, short enough to probe at start-up
_PROBE_CALLS = 7


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or ``torch.bfloat16``, ``"bf16"``) -> ``torch.bfloat16``; only ``values.dtype.DTYPES``'s."""
    canonical = canonical_dtype(str(name))
    if canonical not in DTYPES:
        raise InvalidDtypeError(f"dtype={name!r} is invalid here: expected one of {DTYPES} (resolve it first)")
    return getattr(torch, canonical)


def matmul_gflops(dtype: torch.dtype, shape: tuple[int, int, int] = _PROBE_SHAPE, calls: int = _PROBE_CALLS) -> float:
    """GFLOP/s of ``torch.mm`` at ``shape`` and ``dtype`` on the CPU: the fastest of ``calls`` after one warm-up.

    The fastest, not the median: on a shared machine another process only ever
    slows a sample, so a median of short samples can rate a native bfloat16
    below float32 and choose the slower dtype.
    """
    rows, inner, out = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=gen).to(dtype)
    b = torch.randn(inner, out, generator=gen).to(dtype)
    torch.mm(a, b)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2.0 * rows * inner * out / min(times) / 1e9


@functools.cache
def probe_numerics(device: str = "cpu") -> DeviceNumerics:
    """The device's numerics facts; the CPU's matmul probe runs only where bfloat16 instructions are reported."""
    kind = torch.device(device).type
    if kind == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
        return DeviceNumerics("cuda", name, bool(torch.cuda.is_bf16_supported()))
    flags = (
        ("amx_tile", bool(torch.cpu._is_amx_tile_supported())),
        ("avx512_bf16", bool(torch.cpu._is_avx512_bf16_supported())),
        ("amx_fp16", bool(getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)())),
    )
    bf16_matrix = flags[0][1] or flags[1][1]
    rates = {}
    if bf16_matrix:
        rates = {name: matmul_gflops(getattr(torch, name)) for name in ("float32", "bfloat16")}
    return DeviceNumerics("cpu", torch.backends.cpu.get_cpu_capability(), bf16_matrix, rates, flags)


def choose_dtype(request: str, checkpoint: str | None, device: str = "cpu") -> DtypeChoice:
    """``prefill_core.values.dtype.resolve_dtype`` with the device probed only when the request is ``native``."""
    needs_probe = canonical_dtype(request) == "native"
    return resolve_dtype(request, checkpoint, probe_numerics(device) if needs_probe else None)
