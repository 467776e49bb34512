"""Which floating-point dtype a model runs in: the caller's request, resolved against the checkpoint and the device.

Theory of operation. A request is one of

* ``float32``, ``bfloat16``, ``float16`` (or ``fp32``, ``bf16``, ``fp16``):
  exactly that dtype, fast or not;
* ``auto``: the checkpoint's own dtype, as lm-eval's ``hf`` model and
  transformers' ``dtype="auto"`` mean it (``config.json``'s ``dtype``; a
  GGUF file or a random preset has none, and transformers loads those in
  float32);
* ``native``: the fastest dtype the device computes natively. On a CUDA
  device that is bfloat16 where the device supports it; on a CPU it is
  bfloat16 only where the CPU has bfloat16 matrix instructions (AMX tiles or
  AVX-512 BF16) *and* a matmul probe at bfloat16 runs at least
  ``NATIVE_BF16_SPEEDUP`` times the float32 probe: an instruction set the
  CPU reports but that torch does not reach would otherwise pick a dtype
  that is slower and less exact. Everywhere else float32.

Rules: the resolution is a pure function of its three inputs; an unknown
request is an ``InvalidDtypeError`` naming it and the accepted names;
``native`` never picks a dtype the probe did not measure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from prefill_core.values.errors import InvalidDtypeError, PrefillConfigError

__all__ = [
    "AUTO",
    "DTYPES",
    "DTYPE_REQUESTS",
    "DeviceNumerics",
    "DtypeChoice",
    "NATIVE",
    "NATIVE_BF16_SPEEDUP",
    "canonical_dtype",
    "resolve_dtype",
]

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a model runs in (torch's names)."""
AUTO = "auto"
NATIVE = "native"
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_REQUESTS = (*DTYPES, AUTO, NATIVE)
"""What a caller may ask for (``_ALIASES`` too)."""
NATIVE_BF16_SPEEDUP = 1.5
"""How much faster than float32 the bfloat16 probe must be for ``native`` to pick bfloat16 on a CPU."""


def canonical_dtype(request: str, field: str = "dtype") -> str:
    """``request`` as one of ``DTYPE_REQUESTS`` (aliases and a ``torch.`` prefix removed, any case)."""
    text = str(request).strip().lower().removeprefix("torch.")
    text = _ALIASES.get(text, text)
    if text not in DTYPE_REQUESTS:
        accepted = ", ".join((*DTYPE_REQUESTS, *_ALIASES))
        msg = f"{field}={request!r} is invalid: expected one of {accepted}"
        raise InvalidDtypeError(msg)
    return text


def _rates(value: Mapping[Any, Any]) -> tuple[tuple[str, float], ...]:
    """A mapping (or ``(name, rate)`` pairs) of rates as sorted ``(str, float)`` pairs: hashable and frozen."""
    return tuple(sorted((str(k), float(v)) for k, v in dict(value).items()))


@attrs.frozen
class DeviceNumerics:
    """What one device computes natively, as the shell probed it (``backends.numerics.probe_numerics``).

    ``matmul_gflops`` holds a short torch.mm probe's rate per dtype name;
    ``bf16_matrix`` is whether the device reports bfloat16 matrix
    instructions (a CPU's AMX tiles or AVX-512 BF16; a CUDA device's bf16 support).
    """

    device_type: str
    capability: str
    bf16_matrix: bool
    matmul_gflops: tuple[tuple[str, float], ...] = attrs.field(default=(), converter=_rates)
    flags: tuple[tuple[str, bool], ...] = ()

    def rate(self, dtype: str) -> float | None:
        """The probe's GFLOP/s at ``dtype``, or None where it was not probed."""
        return dict(self.matmul_gflops).get(dtype)

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready form (benchmarks name the machine with it)."""
        return {
            "device_type": self.device_type,
            "capability": self.capability,
            "bf16_matrix": self.bf16_matrix,
            "matmul_gflops": dict(self.matmul_gflops),
            **{name: value for name, value in self.flags},
        }


@attrs.frozen
class DtypeChoice:
    """The dtype a run uses, what was asked for, and why (one line the command lines print)."""

    dtype: str
    requested: str
    reason: str

    def describe(self) -> str:
        return f"{self.dtype} ({self.reason})"


def _native(numerics: DeviceNumerics) -> DtypeChoice:
    if numerics.device_type != "cpu":
        if numerics.bf16_matrix:
            return DtypeChoice("bfloat16", NATIVE, f"{numerics.capability} computes bfloat16 natively")
        return DtypeChoice("float32", NATIVE, f"{numerics.capability} has no bfloat16 support")
    if not numerics.bf16_matrix:
        return DtypeChoice("float32", NATIVE, f"CPU {numerics.capability} has neither AMX nor AVX-512 BF16")
    bf16, fp32 = numerics.rate("bfloat16"), numerics.rate("float32")
    if bf16 is None or fp32 is None:
        return DtypeChoice("float32", NATIVE, "no matmul probe at both float32 and bfloat16")
    speedup = bf16 / fp32
    measured = f"bfloat16 matmul probe {bf16:.0f} vs float32 {fp32:.0f} GFLOP/s"
    if speedup >= NATIVE_BF16_SPEEDUP:
        return DtypeChoice("bfloat16", NATIVE, f"{measured}, {speedup:.1f}x")
    return DtypeChoice("float32", NATIVE, f"{measured}: under {NATIVE_BF16_SPEEDUP}x, not worth its rounding")


def resolve_dtype(request: str, checkpoint: str | None, numerics: DeviceNumerics | None) -> DtypeChoice:
    """The dtype to run ``request`` in (see the module's rules).

    ``checkpoint`` is the stored dtype (None: the checkpoint names none, so
    float32 as transformers loads it); ``numerics`` is needed only for
    ``native`` (None there is a ``PrefillConfigError``).
    """
    name = canonical_dtype(request)
    if name in DTYPES:
        return DtypeChoice(name, name, "as requested")
    if name == AUTO:
        if checkpoint is None:
            return DtypeChoice("float32", AUTO, "the checkpoint names no dtype: float32, as transformers loads it")
        stored = canonical_dtype(checkpoint, "checkpoint dtype")
        if stored not in DTYPES:
            raise InvalidDtypeError(f"checkpoint dtype={checkpoint!r} is invalid: expected one of {DTYPES}")
        return DtypeChoice(stored, AUTO, "the checkpoint's dtype")
    if numerics is None:
        raise PrefillConfigError("dtype='native' needs the device's probed numerics")
    return _native(numerics)
