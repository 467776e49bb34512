"""``Projection``: one weight matrix of the reference Llama, applied as ``x @ W^T``.

On the CPU in float32, and in bfloat16 where the CPU has bfloat16 matrix
instructions (AMX or AVX-512 BF16), the weight is also held reordered into
oneDNN's blocked layout, once, at load (the kernel ``torch.compile``'s CPU
weight prepacking uses). ``F.linear`` hands the plain weight to the BLAS on
every call. A product of up to ``packed_row_limit(dtype)`` rows runs
oneDNN's linear on the prepacked weight, a longer one the plain expression
on the plain weight the object holds anyway. The limit is the core's
``prefill_core.values.linear_form.prepacked_row_limit`` over a probe of
both forms on this machine (``backends.numerics.linear_form_probe``): a
few hundred rows where the BLAS's own blocking wins long products, every
row count where oneDNN's prepacked form is faster throughout
(``benchmarks/host_forms.py``, rows ``lm_head_*``, ``qkv_*`` and
``swiglu_mlp_*``, time both forms on either side of the limit). The fused
forms put SwiGLU's activation and the residual add into the GEMM calls: in
bfloat16 that is one rounding where the plain expressions round after each
op (the results agree with them to bf16 rounding, so a row's bfloat16
outputs can differ in their last bits with the size of the step it runs
in), and no separate pass over the activations for either. SwiGLU's
product is the exception past ``PACKED_MAX_ROWS`` rows: there oneDNN's
fused multiply ran slower than its plain GEMM followed by an in-place
``mul_``, which ``times`` takes (``benchmarks/host_forms.py``,
``up_times_*``); under it the fused multiply is the faster.

Elsewhere (CUDA, float16, bfloat16 without matrix instructions, a torch
built without oneDNN) every form is the plain ``F.linear`` expression it
stands for.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F

from prefill_core.values.linear_form import SHORT_ROWS, parse_prepacked_rows, prepacked_row_limit
from prefill_shell.backends.numerics import linear_form_probe

__all__ = ["PACKED_MAX_ROWS", "Projection", "packed_row_limit", "prepacks"]

_PACK_FOR_ROWS = 1024
"""The row count oneDNN picks its weight layout for; any row count runs on it."""

PACKED_MAX_ROWS = SHORT_ROWS
"""The limit where long products take the plain weight (the core's ``SHORT_ROWS``)."""

ROWS_SETTING = "PREFILL_CPU_PREPACKED_ROWS"
"""Environment setting that overrides the probe: ``auto`` (default), ``short``, ``all`` or a row count."""


@functools.cache
def _bf16_matrix() -> bool:
    """The CPU has bfloat16 matrix instructions and oneDNN takes bfloat16 (the flags ``numerics.py`` reads)."""
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return bool(native and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepacks(weight: torch.Tensor) -> bool:
    """Whether ``Projection`` holds ``weight`` prepacked for oneDNN: CPU, oneDNN built in, and float32 or a
    bfloat16 the CPU computes natively (elsewhere oneDNN would emulate bfloat16, slower than the BLAS)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and _bf16_matrix())


@functools.cache
def packed_row_limit(dtype: torch.dtype) -> int:
    """The most rows a product at ``dtype`` runs on a prepacked weight, decided once per process.

    ``ROWS_SETTING`` wins; under ``auto`` both forms are probed at the dtype.
    """
    setting = parse_prepacked_rows(os.environ.get(ROWS_SETTING))
    probe = linear_form_probe(dtype) if setting == "auto" else None
    limit = prepacked_row_limit(probe, setting)
    return sys.maxsize if limit is None else limit


class Projection:
    """``x @ W^T (+ b)`` for a ``[out, in]`` weight and an optional ``[out]`` bias.

    ``weight`` and ``bias`` stay the plain tensors (``state_dict`` shares them).
    Only ``__call__`` and ``plus`` take the bias: they are the attention's
    projections, the ones a family may give biases; the SwiGLU forms have none.
    """

    __slots__ = ("weight", "bias", "max_rows", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self._packed = None
        self.max_rows = 0
        """The most rows a product runs on the prepacked weight (0: none is held)."""
        if prepacks(weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)
            self.max_rows = packed_row_limit(weight.dtype)

    def _on_packed(self, x: torch.Tensor) -> bool:
        """Whether this product runs on the prepacked weight: one is held and ``x`` has few enough rows."""
        return self._packed is not None and x.numel() <= self.max_rows * x.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b``."""
        if not self._on_packed(x):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ W^T)``: SwiGLU's gate."""
        if not self._on_packed(x):
            return F.silu(F.linear(x, self.weight), inplace=True)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "swish", [], "")

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x @ W^T) * other``: SwiGLU's up projection times the gate."""
        if not self._on_packed(x):
            return F.linear(x, self.weight).mul_(other)
        if x.numel() <= PACKED_MAX_ROWS * x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self._packed, None, "mul")
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "").mul_(other)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``other + (x @ W^T + b)`` as a new tensor: a residual add."""
        if not self._on_packed(x):
            out = torch.addmm(other, x, self.weight.t())
            return out if self.bias is None else out.add_(self.bias)
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self._packed, self.bias, "add")
