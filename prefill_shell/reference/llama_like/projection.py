"""``Projection``: one weight matrix of the reference Llama, applied as ``x @ W^T``.

On the CPU in float32, and in bfloat16 where the CPU has bfloat16 matrix
instructions (AMX or AVX-512 BF16), the weight is also held reordered into
oneDNN's blocked layout, once, at load, and a product of up to
``PACKED_MAX_ROWS`` rows runs oneDNN's linear on it (the kernel
``torch.compile``'s CPU weight prepacking uses). ``F.linear`` hands the plain
weight to the BLAS on every call. On this project's CPUs the prepacked form
is the faster one for a few rows (decode-sized LM heads, short prompts,
cached continuations) and the plain weight past a few hundred
(``benchmarks/host_forms.py``, rows ``lm_head_*``, ``qkv_*`` and
``swiglu_mlp_*``), so a longer product runs the plain expression on the
plain weight the object holds anyway. The fused forms put SwiGLU's
activation, its product and the residual add into the same kernel calls: in
bfloat16 that is one rounding where the plain expressions round after each
op (the results agree with them to bf16 rounding, so a row's bfloat16
outputs can differ in their last bits with the size of the step it runs
in), and an MLP of three kernel calls where the plain one takes four or five
ops over the activations, a strided SiLU among them.

Elsewhere (CUDA, float16, bfloat16 without matrix instructions, a torch
built without oneDNN) every form is the plain ``F.linear`` expression it
stands for.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["Projection", "prepacks"]

_PACK_FOR_ROWS = 1024
"""The row count oneDNN picks its weight layout for; any row count runs on it."""

PACKED_MAX_ROWS = 256
"""The most rows a product takes on the prepacked weight; more take the plain weight.

A long step's GEMMs are large enough that the BLAS's own blocking of the plain
weight wins, and oneDNN's fixed layout stops paying; a short one's are not
(``benchmarks/host_forms.py``: ``*_packed_over_chosen`` past the limit,
``*_plain_over_chosen`` under it)."""


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


class Projection:
    """``x @ W^T (+ b)`` for a ``[out, in]`` weight and an optional ``[out]`` bias.

    ``weight`` and ``bias`` stay the plain tensors (``state_dict`` shares them).
    Only ``__call__`` and ``plus`` take the bias: they are the attention's
    projections, the ones a family may give biases; the SwiGLU forms have none.
    """

    __slots__ = ("weight", "bias", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS) if prepacks(weight) else None

    def _on_packed(self, x: torch.Tensor) -> bool:
        """Whether this product runs on the prepacked weight: one is held and ``x`` has few enough rows."""
        return self._packed is not None and x.numel() <= PACKED_MAX_ROWS * x.shape[-1]

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
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self._packed, None, "mul")

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``other + (x @ W^T + b)`` as a new tensor: a residual add."""
        if not self._on_packed(x):
            out = torch.addmm(other, x, self.weight.t())
            return out if self.bias is None else out.add_(self.bias)
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self._packed, self.bias, "add")
