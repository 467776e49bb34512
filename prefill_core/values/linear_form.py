"""How many rows a CPU projection runs on its weight prepacked for oneDNN, decided from a probe of both forms.

Theory of operation. The reference models hold each CPU weight twice: as
the plain tensor the BLAS takes (``F.linear``) and reordered once into
oneDNN's blocked layout. A short product (decode-sized LM heads, short
prompts, cached continuations) runs faster on the prepacked weight on every
CPU this project has measured. A long one differs by machine: MKL's float32
GEMM beat oneDNN's fixed layout past a few hundred rows on an Intel Xeon,
while on an AMD EPYC oneDNN's prepacked float32 GEMM ran faster than MKL's
at every row count. And the prepacked form fuses SwiGLU's activation, its
product and the residual add into its GEMM calls, which saves passes over
the activations even where the bare GEMMs tie (bfloat16 on that EPYC). So
the shell times both forms once per dtype on one long SwiGLU MLP
(``backends.numerics.linear_form_probe``) and this module turns the two
rates into a row limit.

Rules:

* a product of at most ``SHORT_ROWS`` rows runs prepacked (where a
  prepacked weight is held at all);
* a longer one runs prepacked where the probe's prepacked rate is at
  least ``PREPACKED_MARGIN`` times its plain rate. The margin is 1: a tie
  goes to the prepacked form, whose fused epilogues save more passes over
  longer steps than over the probe's (``benchmarks/host_forms.py``'s
  ``swiglu_mlp_*`` rows), and a threshold above 1 would put the probe's
  noise band where the forms already differ;
* a caller's setting (``PREFILL_CPU_PREPACKED_ROWS``: ``auto``, ``short``,
  ``all`` or a row count) overrides the probe, for reproducible runs.
"""

from __future__ import annotations

import attrs

from prefill_core.values.errors import PrefillConfigError

__all__ = [
    "ALL_ROWS",
    "PREPACKED_MARGIN",
    "SHORT_ROWS",
    "LinearFormProbe",
    "parse_prepacked_rows",
    "prepacked_row_limit",
]

SHORT_ROWS = 256
"""Products of at most this many rows run on the prepacked weight whatever the probe says."""

PREPACKED_MARGIN = 1.0
"""How much faster than the plain weight the prepacked one must probe to take long products too."""

ALL_ROWS = None
"""``prepacked_row_limit``'s answer where every product runs prepacked."""


def _positive(_instance, attribute, value) -> None:
    if not value > 0:
        raise PrefillConfigError(f"LinearFormProbe.{attribute.name}={value!r} must be positive")


@attrs.frozen
class LinearFormProbe:
    """Both forms' GFLOP/s on one SwiGLU MLP of ``rows`` rows at ``dtype``, timed interleaved."""

    dtype: str
    rows: int = attrs.field(validator=_positive)
    plain_gflops: float = attrs.field(validator=_positive)
    prepacked_gflops: float = attrs.field(validator=_positive)

    @property
    def prepacked_over_plain(self) -> float:
        return self.prepacked_gflops / self.plain_gflops


def parse_prepacked_rows(text: str | None) -> str | int:
    """A setting as ``"auto"``, ``"short"``, ``"all"`` or a positive row count; unset is ``"auto"``."""
    value = (text or "auto").strip().lower()
    if value in ("auto", "short", "all"):
        return value
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise PrefillConfigError(
        f"PREFILL_CPU_PREPACKED_ROWS={text!r} is invalid: expected auto, short, all or a positive row count"
    )


def prepacked_row_limit(probe: LinearFormProbe | None, setting: str | int = "auto") -> int | None:
    """The most rows a product runs on the prepacked weight; None: every product (``ALL_ROWS``).

    ``probe`` is needed only for ``"auto"``; without one ``"auto"`` keeps the
    short limit (a machine not probed is not assumed to favour either form).
    """
    if isinstance(setting, int):
        return setting
    if setting == "all":
        return ALL_ROWS
    if setting == "short" or probe is None:
        return SHORT_ROWS
    return ALL_ROWS if probe.prepacked_over_plain >= PREPACKED_MARGIN else SHORT_ROWS
