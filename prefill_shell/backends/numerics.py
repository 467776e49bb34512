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
import torch.nn.functional as F

from prefill_core.values.dtype import DTYPES, DeviceNumerics, DtypeChoice, canonical_dtype, resolve_dtype
from prefill_core.values.errors import InvalidDtypeError
from prefill_core.values.linear_form import LinearFormProbe

__all__ = ["choose_dtype", "linear_form_probe", "matmul_gflops", "probe_numerics", "torch_dtype"]

_PROBE_SHAPE = (256, 512, 1024)  # rows x inner x out: a small model's MLP, short enough to probe at start-up
_PROBE_CALLS = 7
_LINEAR_PROBE_SHAPE = (1024, 512, 1376)  # rows x hidden x intermediate: a long step through a small model's MLP
_LINEAR_PROBE_ROUNDS = 5


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
def linear_form_probe(dtype: torch.dtype) -> LinearFormProbe:
    """GFLOP/s of one long SwiGLU MLP (with its residual add) in both of ``Projection``'s forms.

    The plain form is ``F.linear``, ``silu``, ``mul_`` and ``addmm`` on the
    plain weights; the prepacked one is oneDNN's linear on weights reordered
    once, with the activation, the product and the residual add fused into
    its three calls. The MLP, not one bare GEMM, because that is most of a
    layer's work and what the row limit decides: where the bare GEMMs tie,
    the fused epilogues' saved passes still count. The two forms alternate
    for ``_LINEAR_PROBE_ROUNDS`` rounds after a warm-up each, and each keeps its
    fastest round (another process only ever slows a sample). Run once per
    dtype and process, and only where a prepacked weight is held
    (``reference.llama_like.projection``).
    """
    rows, hidden, inner = _LINEAR_PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(2))
    gate, up = ((torch.randn(inner, hidden, generator=gen) / hidden**0.5).to(dtype) for _ in range(2))
    down = (torch.randn(hidden, inner, generator=gen) / inner**0.5).to(dtype)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in (gate, up, down)]
    linear = torch.ops.mkldnn._linear_pointwise

    def plain():
        product = F.linear(x, up).mul_(F.silu(F.linear(x, gate), inplace=True))
        return torch.addmm(residual, product, down.t())

    def prepacked():
        activated = linear(x, packed[0], None, "swish", [], "")
        return linear.binary(linear.binary(x, activated, packed[1], None, "mul"), residual, packed[2], None, "add")

    forms = {"plain": plain, "prepacked": prepacked}
    best = dict.fromkeys(forms, float("inf"))
    with torch.inference_mode():
        for form in forms.values():
            form()
        for _ in range(_LINEAR_PROBE_ROUNDS):
            for name, form in forms.items():
                start = time.perf_counter()
                form()
                best[name] = min(best[name], time.perf_counter() - start)
    flops = 2.0 * rows * hidden * inner * 3 / 1e9
    name = str(dtype).removeprefix("torch.")
    return LinearFormProbe(name, rows, flops / best["plain"], flops / best["prepacked"])


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
