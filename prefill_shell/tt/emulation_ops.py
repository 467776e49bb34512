"""The ops of ``ReferenceEmulation``: ttnn's golden functions, plus the project's own where a golden does not compute.

Each entry takes the real ``ttnn`` module and host ``ttnn.Tensor`` arguments
(the emulation unwraps its device tensors) and returns host tensors in the
dtype and layout ttnn's documentation gives for the op's output:

==================  ==============================================  =================================
op                  computed by                                     output
==================  ==============================================  =================================
reshape, to_layout  ``golden_function``                             input dtype; layout kept / given
unsqueeze_to_4D     ``golden_function``                             input dtype and layout
typecast            ``golden_function``                             the requested dtype, input layout
arange              ``golden_function``                             ``dtype`` (bfloat16), ROW_MAJOR
add                 ``golden_function``                             ``dtype`` or input a's; a's layout
clamp               ``golden_function`` (scalar bounds)             input dtype and layout
embedding           ``golden_function``                             ``dtype`` or the weight's; ``layout``
                                                                    (ROW_MAJOR by default)
argmax              ``golden_function``                             uint32 ROW_MAJOR
topk                ``golden_function``                             values like the input; indices
                                                                    TILE, uint16 (uint32 once the
                                                                    padded width reaches 65536)
moreh_logsoftmax    ``golden_function``                             input dtype and layout
gather              ``golden_function``                             input dtype and layout
pad, slice          ``golden_function``                             input dtype and layout
transformer.chunked ``golden_function`` (``sliding_window_size``     q's dtype and layout
_scaled_dot_product and every other keyword passed through; one
_attention          chunk start for the batch)
all_gather          the project's own: one chip holds the whole     input dtype and layout
                    tensor, so the gather is a copy
sampling            the project's own: ``torch_sampling.          uint32 ROW_MAJOR ``[1, 1, 1, B]``
                    sample_row`` per row over the candidates with
                    that row's K, P and T = 1 / temp; ttnn's golden
                    returns zeros. Row b draws with seed + b.
==================  ==============================================  =================================

Input contracts ttnn documents for these ops are checked before computing
(``_require``): a swapped argument fails here instead of computing garbage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from prefill_shell.sampling.torch_sampling import sample_row

__all__ = ["OPS", "host_of", "require_same_spec", "torch_of"]

_UINT16_LIMIT = 1 << 16


def _require(condition: bool, rule: str) -> None:
    if not condition:
        from .emulation import EmulationError

        raise EmulationError(f"ttnn contract broken: {rule}")


def _is_int(tt: Any, dtype: Any) -> bool:
    return dtype in (tt.uint32, tt.int32, tt.uint16)


def torch_of(tt: Any, host: Any) -> torch.Tensor:
    """``ttnn.to_torch``; integer tensors widened to int64 (torch has few uint32 kernels)."""
    value = tt.to_torch(host)
    return value.to(torch.int64) if _is_int(tt, host.dtype) else value


def host_of(tt: Any, value: torch.Tensor, dtype: Any, layout: Any) -> Any:
    """``ttnn.from_torch`` into ``dtype``/``layout``; cast in torch first so a TILE conversion only tilizes."""
    if _is_int(tt, dtype):
        value = value.to(torch.int32)
    else:
        value = value.to(torch.bfloat16 if dtype == tt.bfloat16 else torch.float32)
    return tt.from_torch(value.contiguous(), dtype=dtype, layout=layout)


def require_same_spec(name: str, source: Any, dest: Any) -> None:
    spec = (tuple(source.shape), source.dtype, source.layout)
    target = (tuple(dest.shape), dest.dtype, dest.layout)
    _require(spec == target, f"{name} needs equal shape, dtype and layout: {spec} into {target}")


def _golden(tt: Any, name: str) -> Callable:
    return getattr(tt, name).golden_function


def _reshape(tt, x, shape, *args, **kw):
    return host_of(tt, _golden(tt, "reshape")(torch_of(tt, x), tuple(shape)), x.dtype, x.layout)


def _to_layout(tt, x, layout, dtype=None, **kw):
    out = _golden(tt, "to_layout")(torch_of(tt, x), layout)
    return host_of(tt, out, dtype or x.dtype, layout)


def _unsqueeze_to_4d(tt, x):
    return host_of(tt, _golden(tt, "unsqueeze_to_4D")(torch_of(tt, x)), x.dtype, x.layout)


def _typecast(tt, x, dtype, **kw):
    return host_of(tt, _golden(tt, "typecast")(torch_of(tt, x), dtype=dtype), dtype, x.layout)


def _arange(tt, start, end, step=1, *, dtype=None, device=None, layout=None, **kw):
    dtype = tt.bfloat16 if dtype is None else dtype
    out = _golden(tt, "arange")(start, end, step, dtype=dtype)
    return host_of(tt, out, dtype, layout or tt.ROW_MAJOR_LAYOUT)


def _add(tt, a, b, *, dtype=None, **kw):
    _require(not hasattr(b, "dtype") or a.dtype == b.dtype, "add: inputs of one dtype")
    other = torch_of(tt, b) if hasattr(b, "layout") else b
    return host_of(tt, _golden(tt, "add")(torch_of(tt, a), other), dtype or a.dtype, a.layout)


def _clamp(tt, x, min=None, max=None, **kw):
    _require(not hasattr(min, "layout") and not hasattr(max, "layout"), "clamp: scalar bounds (INT32 takes no others)")
    return host_of(tt, _golden(tt, "clamp")(torch_of(tt, x), min=min, max=max), x.dtype, x.layout)


def _embedding(tt, ids, weight, *, layout=None, dtype=None, **kw):
    _require(ids.dtype == tt.uint32 and ids.layout == tt.ROW_MAJOR_LAYOUT, "embedding: ids uint32 ROW_MAJOR")
    out = _golden(tt, "embedding")(torch_of(tt, ids), torch_of(tt, weight))
    return host_of(tt, out, dtype or weight.dtype, layout or tt.ROW_MAJOR_LAYOUT)


def _argmax(tt, x, dim=None, keepdim=False, **kw):
    _require(x.layout == tt.ROW_MAJOR_LAYOUT, "argmax: ROW_MAJOR input")
    out = _golden(tt, "argmax")(torch_of(tt, x), dim=dim, keepdim=keepdim)
    return host_of(tt, out, tt.uint32, tt.ROW_MAJOR_LAYOUT)


def _topk(tt, x, k=32, dim=-1, largest=True, sorted=True, **kw):
    _require(x.layout == tt.TILE_LAYOUT and k <= int(x.shape[dim]), "topk: TILE input, k <= its width")
    values, indices = _golden(tt, "topk")(torch_of(tt, x), k, dim, largest, sorted)
    # tt-metal's TopK output spec: uint16 indices only while the tile-padded width fits 16 bits.
    index_dtype = tt.uint16 if int(x.padded_shape[dim]) < _UINT16_LIMIT else tt.uint32
    return host_of(tt, values, x.dtype, x.layout), host_of(tt, indices, index_dtype, tt.TILE_LAYOUT)


def _moreh_logsoftmax(tt, x, dim, **kw):
    _require(x.layout == tt.TILE_LAYOUT, "moreh_logsoftmax: TILE input")
    return host_of(tt, _golden(tt, "moreh_logsoftmax")(torch_of(tt, x), dim), x.dtype, x.layout)


def _gather(tt, x, dim, index, **kw):
    _require(isinstance(dim, int), f"gather: dim must be an int, got {type(dim).__name__}")
    _require(
        index.dtype in (tt.uint32, tt.uint16) and index.layout == tt.TILE_LAYOUT, "gather: index uint32/uint16 TILE"
    )
    _require(len(index.shape) == len(x.shape), "gather: index and input of equal rank")
    return host_of(tt, _golden(tt, "gather")(torch_of(tt, x), dim, torch_of(tt, index)), x.dtype, x.layout)


def _pad(tt, x, padding, value, **kw):
    return host_of(tt, _golden(tt, "pad")(torch_of(tt, x), padding, value=value), x.dtype, x.layout)


def _slice(tt, x, starts, ends, steps=None, **kw):
    return host_of(tt, _golden(tt, "slice")(torch_of(tt, x), starts, ends, steps), x.dtype, x.layout)


def _all_gather(tt, x, dim, **kw):
    return host_of(tt, torch_of(tt, x), x.dtype, x.layout)


def _sampling(tt, values, indices, k, p, temp, *, seed=None, **kw):
    users = int(values.shape[-2])
    _require(values.dtype == tt.bfloat16 and values.layout == tt.TILE_LAYOUT, "sampling: values bfloat16 TILE")
    _require(len(values.shape) == 4 and tuple(values.shape)[:2] == (1, 1), "sampling: values [1, 1, users, W]")
    width = int(values.shape[-1])
    _require(width > 0 and width % 32 == 0, "sampling: W a non-zero multiple of 32")
    _require((width // 32) & (width // 32 - 1) == 0, "sampling: W / 32 a power of two")
    _require(1 <= users <= 32, "sampling: 1 to 32 users")
    _require(
        tuple(indices.shape) == tuple(values.shape) and indices.layout == tt.ROW_MAJOR_LAYOUT,
        "sampling: indices shaped like values, ROW_MAJOR",
    )
    _require(
        indices.dtype in (tt.uint32, tt.int32) and k.dtype in (tt.uint32, tt.int32), "sampling: uint32 indices and k"
    )
    for name, t in (("k", k), ("p", p), ("temp", temp)):
        _require(tuple(t.shape) == (users,) and t.layout == tt.ROW_MAJOR_LAYOUT, f"sampling: {name} ROW_MAJOR [users]")
    _require(p.dtype == tt.bfloat16 and temp.dtype == tt.bfloat16, "sampling: p and temp bfloat16")
    scores, ids = torch_of(tt, values).reshape(users, -1).float(), torch_of(tt, indices).reshape(users, -1)
    top_k, top_p, inverse_t = torch_of(tt, k), torch_of(tt, p).float(), torch_of(tt, temp).float()
    tokens = torch.empty(1, 1, 1, users, dtype=torch.int64)
    for row in range(users):
        pick = sample_row(
            scores[row], int(top_k[row]), float(top_p[row]), 1.0 / float(inverse_t[row]), (seed or 0) + row
        )
        tokens[0, 0, 0, row] = ids[row, int(pick)]
    return host_of(tt, tokens, tt.uint32, tt.ROW_MAJOR_LAYOUT)


def _chunked_sdpa(tt, q, k, v, page_table, chunk_start_idx=None, *, chunk_start_idx_tensor=None, **kw):
    """``transformer.chunked_scaled_dot_product_attention`` through its golden (``sliding_window_size`` included)."""
    _require(len(q.shape) == 4 and len(k.shape) == 4, "chunked sdpa: q [B, H, S, D], paged k/v [blocks, H, bs, D]")
    start = (
        chunk_start_idx if chunk_start_idx_tensor is None else int(torch_of(tt, chunk_start_idx_tensor).flatten()[0])
    )
    golden = tt.transformer.chunked_scaled_dot_product_attention.golden_function
    out = golden(torch_of(tt, q), torch_of(tt, k), torch_of(tt, v), torch_of(tt, page_table), start, **kw)
    return host_of(tt, out, q.dtype, q.layout)


OPS: dict[str, Callable] = {
    "reshape": _reshape,
    "to_layout": _to_layout,
    "unsqueeze_to_4D": _unsqueeze_to_4d,
    "typecast": _typecast,
    "arange": _arange,
    "add": _add,
    "clamp": _clamp,
    "embedding": _embedding,
    "argmax": _argmax,
    "topk": _topk,
    "moreh_logsoftmax": _moreh_logsoftmax,
    "gather": _gather,
    "pad": _pad,
    "slice": _slice,
    "all_gather": _all_gather,
    "sampling": _sampling,
    "transformer.chunked_scaled_dot_product_attention": _chunked_sdpa,
}
