"""Host staging for the ttnn backend: host step values -> ``ttnn.Tensor`` host tensors.

Pure functions, no device. Each turns torch CPU values into a host
``ttnn.Tensor`` with exactly the dtype, layout and shape the tt-metal prefill
programs consume, ready for ``ttnn.to_device`` (a new device input) or
``ttnn.copy_host_to_device_tensor`` (an in-place refresh, which requires the
same shape, dtype and layout: these functions are the only producer of both,
so a refresh always matches its target).

Inputs (``B`` padded wave, ``S`` chunk length, ``W`` page-table width; names
are ``contract.TensorSpec`` names):

::

  value         dtype    layout      shape            consumer
  input_tokens  uint32   ROW_MAJOR   [1, 1, B, S]     ``ttnn.embedding`` ids; one row is
                                                      ``[1, 1, 1, S]``, tt_transformers'
                                                      ``prepare_inputs_prefill`` form; a wave
                                                      stacks rows on dim 2 (the row-major
                                                      ``[1, 1, 1, B*S]`` view is a free reshape)
  fill_table    int32    ROW_MAJOR   [B, Wf]          ``paged_fill_cache`` page_table (-1 skips)
  read_table    int32    ROW_MAJOR   [B, Wr]          chunked SDPA ``page_table_tensor``
  chunk_start   int32    ROW_MAJOR   [B]              ``chunk_start_idx_tensor`` (``[1]`` for a
                                                      single-row chunked request)
  slots         int32    ROW_MAJOR   [B]              per-row batch index (``batch_idx_tensor``
                                                      form); -1 marks a padding row
  last_token_index int32  ROW_MAJOR   [B]              chunk-relative last-token row
  top_k         uint32   ROW_MAJOR   [B]              ``ttnn.sampling`` ``k`` (``[num_users]``)
  top_p         bfloat16 ROW_MAJOR   [B]              ``ttnn.sampling`` ``p`` (never 0)
  temperature   bfloat16 ROW_MAJOR   [B]              ``ttnn.sampling`` ``temp``: staged as 1/T
                                                      (the op multiplies logits by it), never 0
  hidden        bfloat16 TILE        [B, 1, S, H]     a body activation (the model's output)

Chunk starts, slots and tables are tensors, never Python scalars, so a
captured trace reads them from device memory at replay (a trace bakes a
scalar argument into its commands).

Outputs of the device postprocessing (also the persistent workspace of a
traced program alias) are staged as zeros in the form ``TtnnBackend.assign``
copies into: ``last_hidden`` bfloat16 TILE ``[1, 1, B, H]``; ``logits``
float32 TILE ``[1, 1, B, V]``; ``sampled_tokens`` uint32 and ``token_logprob``
float32 ROW_MAJOR ``[1, 1, 1, B]``; ``top_ids`` uint32 and ``top_logprobs``
float32 ROW_MAJOR ``[1, 1, B, N]``. A uint32 value outside ``[0, 2**32 - 1]``
(a -1 filler) raises instead of wrapping.

Every function takes ``mesh_mapper``: ``None`` for a plain host tensor,
``ttnn.ReplicateTensorToMesh(mesh)`` (or a shard mapper for vocab-sharded
logits) to lay the host tensor out for a ``MeshDevice``.

``ttnn`` is imported on first use, so importing this module never loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from prefill_core.values.errors import PrefillInputError
from prefill_shell.device.contract import (
    CHUNK_START,
    FILL_TABLE,
    GROUPED_INPUTS,
    HIDDEN,
    INPUT_TOKENS,
    LAST_HIDDEN,
    LAST_TOKEN_INDEX,
    LOGITS,
    PROMPT_HIDDEN,
    PROMPT_INDEX,
    PROMPT_LOGITS,
    PROMPT_LOGPROB,
    PROMPT_TARGETS,
    PROMPT_TOP_IDS,
    PROMPT_TOP_LOGPROBS,
    READ_TABLE,
    SAMPLED_TOKENS,
    SLOTS,
    TEMPERATURE,
    TOKEN_LOGPROB,
    TOP_IDS,
    TOP_K,
    TOP_LOGPROBS,
    TOP_P,
    TensorSpec,
)
from prefill_shell.extras import TTNN_EXTRA, TTNN_PYTHONS, requires_extra

__all__ = [
    "import_ttnn",
    "MAX_DEVICE_TOP_K",
    "TensorContract",
    "stage_tokens",
    "stage_page_table",
    "stage_int_vector",
    "stage_top_k",
    "stage_top_p",
    "stage_temperature",
    "stage_hidden",
    "stage",
    "contract_of",
]

MAX_DEVICE_TOP_K = 32
"""``ttnn.sampling`` accepts k in (0, 32]."""

_UINT32_LIMIT = 1 << 32
_BF16 = torch.finfo(torch.bfloat16)
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


def import_ttnn() -> Any:
    """The ``ttnn`` module; on a Python without its wheel, an error naming the extra and the Pythons it has."""
    with requires_extra(TTNN_EXTRA, "the ttnn backend", pythons=TTNN_PYTHONS):
        import ttnn

    return ttnn


class TensorContract:
    """dtype and layout names of one staged value (``"uint32"``, ``"ROW_MAJOR"``...)."""

    __slots__ = ("dtype", "layout")

    def __init__(self, dtype: str, layout: str):
        self.dtype = dtype
        self.layout = layout

    def resolve(self) -> tuple[Any, Any]:
        ttnn = import_ttnn()
        return getattr(ttnn, self.dtype), getattr(ttnn, f"{self.layout}_LAYOUT")

    def __repr__(self) -> str:
        return f"TensorContract({self.dtype}, {self.layout})"


_NUMPY = {"uint32": np.uint32, "int32": np.int32, "float32": np.float32, "bfloat16": np.float32}


def _host(value: torch.Tensor, dtype: str, layout: str, mesh_mapper) -> Any:
    """A host ``ttnn.Tensor`` of ``value`` with ``dtype`` and ``layout``.

    Row-major values go through numpy into ``ttnn.Tensor`` (which copies):
    cheaper than ``ttnn.from_torch``'s DLPack path for these small tensors
    (``benchmarks/staging.py`` times the staging), and exact (unlike the Python-list constructor, which routes
    integers through float). Tiled values use ``from_torch``, which tilizes.
    """
    if layout == "ROW_MAJOR":
        source = value.float() if value.dtype == torch.bfloat16 else value
        return _row_major(source.numpy(), dtype, mesh_mapper)
    ttnn = import_ttnn()
    return ttnn.from_torch(value, dtype=getattr(ttnn, dtype), layout=ttnn.TILE_LAYOUT, mesh_mapper=mesh_mapper)


def _row_major(array: np.ndarray, dtype: str, mesh_mapper) -> Any:
    ttnn = import_ttnn()
    array = np.ascontiguousarray(array, dtype=_NUMPY[dtype])
    return ttnn.Tensor(array, getattr(ttnn, dtype), None, ttnn.ROW_MAJOR_LAYOUT, mesh_mapper=mesh_mapper)


def _out_of_range(name: str, values: torch.Tensor, low: int, high: int) -> PrefillInputError:
    bad = values.lt(low) | values.gt(high)
    where = tuple(int(i) for i in bad.nonzero()[0])
    msg = f"{name}{list(where)}={int(values[where])} is invalid: must be in [{low}, {high}] for the device dtype"
    return PrefillInputError(msg, field=name)


def _int32_array(name: str, values: torch.Tensor) -> np.ndarray:
    """``values`` as numpy, refusing what int32 cannot hold (numpy and ttnn would wrap it silently)."""
    array = values.numpy()
    if values.dtype != torch.int32 and array.size and (array.min() < _INT32_MIN or array.max() > _INT32_MAX):
        raise _out_of_range(name, values, _INT32_MIN, _INT32_MAX)
    return array


def _outside_uint32(array: np.ndarray) -> bool:
    if array.dtype == np.int64:  # one pass for both bounds: a negative id read as unsigned is >= 2**63
        return bool(array.view(np.uint64).max() >= _UINT32_LIMIT)
    return bool(array.min() < 0 or array.max() >= _UINT32_LIMIT)


# ---------------------------------------------------------------- body inputs


def stage_tokens(tokens: torch.Tensor, mesh_mapper=None) -> Any:
    """int ``[B, S]`` -> uint32 ROW_MAJOR ``[1, 1, B, S]``; ids outside uint32 raise (ttnn would wrap -1)."""
    b, s = tokens.shape
    array = np.ascontiguousarray(tokens.numpy()).reshape(1, 1, b, s)
    if array.size and _outside_uint32(array):
        raise _out_of_range("tokens", tokens, 0, _UINT32_LIMIT - 1)
    return _row_major(array, "uint32", mesh_mapper)


def stage_page_table(table: torch.Tensor, mesh_mapper=None) -> Any:
    """int32 ``[B, W]`` (fill or read table, -1 kept) -> int32 ROW_MAJOR ``[B, W]``."""
    return _row_major(_int32_array("page_table", table), "int32", mesh_mapper)


def stage_int_vector(values: torch.Tensor, mesh_mapper=None, *, name: str = "vector") -> Any:
    """int ``[B]`` (chunk start, slots, last-token index) -> int32 ROW_MAJOR ``[B]``."""
    return _row_major(_int32_array(name, values).reshape(-1), "int32", mesh_mapper)


# ---------------------------------------------------------------- activations


def stage_hidden(hidden: torch.Tensor, mesh_mapper=None) -> Any:
    """A body activation ``[B, S, H]`` -> bfloat16 TILE ``[B, 1, S, H]``.

    Host tilization into a new dtype needs a cluster descriptor without
    hardware (``TT_METAL_MOCK_CLUSTER_DESC_PATH``); casting to bfloat16 in
    torch first makes this a layout-only conversion.
    """
    b, s, h = hidden.shape
    return _host(hidden.reshape(b, 1, s, h).to(torch.bfloat16), "bfloat16", "TILE", mesh_mapper)


# ---------------------------------------------------------------- sampling inputs


def _check_top_k(k: torch.Tensor) -> None:
    bad = (k < 1) | (k > MAX_DEVICE_TOP_K)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        msg = (
            f"physical row {row}: sampling.top_k={int(k[row])} is invalid for ttnn.sampling: "
            f"must be in [1, {MAX_DEVICE_TOP_K}] (set the policy's device_top_k_cap <= {MAX_DEVICE_TOP_K})"
        )
        raise PrefillInputError(msg, field="sampling.top_k")


def _bfloat16_top_p(p: torch.Tensor) -> torch.Tensor:
    # A P below bfloat16's smallest normal rounds to 0 (or to a subnormal that
    # hardware may flush to 0), and P = 0 would drop even the top token. Raising
    # it to the smallest normal changes no outcome: with at most 32 candidates
    # the top token holds >= 1/32 of the mass, so any P that small keeps
    # exactly the top token either way.
    return p.clamp(min=_BF16.tiny)


def _bfloat16_inverse_t(inverse_t: torch.Tensor) -> torch.Tensor:
    # A huge T makes 1/T round to 0, and -inf * 0 is NaN for a masked logit.
    # The smallest normal keeps -inf at -inf while every finite logit still
    # scales to about 0: the uniform draw over the top k that T -> inf means.
    return inverse_t.clamp(min=_BF16.tiny)


def stage_top_k(k: torch.Tensor, mesh_mapper=None) -> Any:
    """``TOP_K`` int ``[B]`` -> uint32 ROW_MAJOR ``[B]``; a K outside ``[1, 32]`` raises."""
    k = k.reshape(-1)
    _check_top_k(k)
    return _host(k, "uint32", "ROW_MAJOR", mesh_mapper)


def stage_top_p(p: torch.Tensor, mesh_mapper=None) -> Any:
    """``TOP_P`` float ``[B]`` -> bfloat16 ROW_MAJOR ``[B]``, never 0."""
    return _host(_bfloat16_top_p(p.reshape(-1).float()), "bfloat16", "ROW_MAJOR", mesh_mapper)


def stage_temperature(t: torch.Tensor, mesh_mapper=None) -> Any:
    """``TEMPERATURE`` float ``[B]`` -> 1/T bfloat16 ROW_MAJOR ``[B]`` (``ttnn.sampling`` multiplies by it), never 0.

    A T whose 1/T overflows bfloat16 raises: staged alone it cannot become
    the greedy triple (K and P are other tensors), and it cannot come from
    ``contract.sampling_values``, which holds T=1 for every greedy row (any
    T below ``GREEDY_TEMPERATURE`` is greedy).
    """
    inverse_t = (1.0 / t.reshape(-1).double()).float()
    cold = inverse_t > _BF16.max
    if bool(cold.any()):
        row = int(cold.nonzero()[0])
        msg = (
            f"physical row {row}: sampling.temperature={float(t.reshape(-1)[row])!r} is invalid for ttnn.sampling: "
            f"its 1/T overflows bfloat16 (a row that cold is greedy and must hold T=1)"
        )
        raise PrefillInputError(msg, field="sampling.temperature")
    return _host(_bfloat16_inverse_t(inverse_t), "bfloat16", "ROW_MAJOR", mesh_mapper)


# ---------------------------------------------------------------- postprocessing outputs


def _exact(spec: TensorSpec, dtype: str, host: torch.Tensor) -> torch.Tensor:
    """``host`` in ``dtype``'s torch form; an id outside uint32 raises (numpy would wrap -1 to 2**32 - 1)."""
    value = host.to(_TORCH[dtype])
    if dtype == "uint32" and value.numel() and _outside_uint32(value.numpy()):
        raise _out_of_range(spec.name, value, 0, _UINT32_LIMIT - 1)
    return value


def _vector_out(spec: TensorSpec, dtype: str) -> Callable:
    def stage(host: torch.Tensor, mesh_mapper=None) -> Any:
        return _host(_exact(spec, dtype, host).reshape(1, 1, 1, -1), dtype, "ROW_MAJOR", mesh_mapper)

    return stage


def _rows_out(spec: TensorSpec, dtype: str, layout: str) -> Callable:
    def stage(host: torch.Tensor, mesh_mapper=None) -> Any:
        b, n = host.shape
        return _host(_exact(spec, dtype, host).reshape(1, 1, b, n), dtype, layout, mesh_mapper)

    return stage


_TORCH = {"uint32": torch.int64, "float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32}


def _int_vector(spec: TensorSpec) -> Callable:
    return lambda host, mesh_mapper=None: stage_int_vector(host, mesh_mapper, name=spec.name)


_ROW_MAJOR_INT32 = TensorContract("int32", "ROW_MAJOR")


def _group_ints(spec: TensorSpec) -> Callable:
    """A hybrid step's per-group table (``[K, B, W]``, ``[K, B]`` or ``[K, B, 2]``) as int32 ROW_MAJOR, same shape.

    Exact, ``-1`` kept: a TTTv2 model takes group g's ``[B, W]`` table by slicing the leading dimension.
    """
    return lambda host, mesh_mapper=None: _row_major(_int32_array(spec.name, host), "int32", mesh_mapper)


# Every contract entry the device sees: how its host value is staged, and
# the dtype and layout that gives on the device.
_STAGING: dict[TensorSpec, tuple[Callable, TensorContract]] = {
    INPUT_TOKENS: (stage_tokens, TensorContract("uint32", "ROW_MAJOR")),
    CHUNK_START: (_int_vector(CHUNK_START), _ROW_MAJOR_INT32),
    SLOTS: (_int_vector(SLOTS), _ROW_MAJOR_INT32),
    FILL_TABLE: (stage_page_table, _ROW_MAJOR_INT32),
    READ_TABLE: (stage_page_table, _ROW_MAJOR_INT32),
    **{spec: (_group_ints(spec), _ROW_MAJOR_INT32) for spec in GROUPED_INPUTS},
    LAST_TOKEN_INDEX: (_int_vector(LAST_TOKEN_INDEX), _ROW_MAJOR_INT32),
    TOP_K: (stage_top_k, TensorContract("uint32", "ROW_MAJOR")),
    TOP_P: (stage_top_p, TensorContract("bfloat16", "ROW_MAJOR")),
    TEMPERATURE: (stage_temperature, TensorContract("bfloat16", "ROW_MAJOR")),
    HIDDEN: (stage_hidden, TensorContract("bfloat16", "TILE")),
    LAST_HIDDEN: (_rows_out(LAST_HIDDEN, "bfloat16", "TILE"), TensorContract("bfloat16", "TILE")),
    LOGITS: (_rows_out(LOGITS, "float32", "TILE"), TensorContract("float32", "TILE")),
    SAMPLED_TOKENS: (_vector_out(SAMPLED_TOKENS, "uint32"), TensorContract("uint32", "ROW_MAJOR")),
    TOKEN_LOGPROB: (_vector_out(TOKEN_LOGPROB, "float32"), TensorContract("float32", "ROW_MAJOR")),
    TOP_IDS: (_rows_out(TOP_IDS, "uint32", "ROW_MAJOR"), TensorContract("uint32", "ROW_MAJOR")),
    TOP_LOGPROBS: (_rows_out(TOP_LOGPROBS, "float32", "ROW_MAJOR"), TensorContract("float32", "ROW_MAJOR")),
    PROMPT_INDEX: (_int_vector(PROMPT_INDEX), _ROW_MAJOR_INT32),
    PROMPT_TARGETS: (_vector_out(PROMPT_TARGETS, "uint32"), TensorContract("uint32", "ROW_MAJOR")),
    PROMPT_HIDDEN: (_rows_out(PROMPT_HIDDEN, "bfloat16", "TILE"), TensorContract("bfloat16", "TILE")),
    PROMPT_LOGITS: (_rows_out(PROMPT_LOGITS, "float32", "TILE"), TensorContract("float32", "TILE")),
    PROMPT_LOGPROB: (_vector_out(PROMPT_LOGPROB, "float32"), TensorContract("float32", "ROW_MAJOR")),
    PROMPT_TOP_IDS: (_rows_out(PROMPT_TOP_IDS, "uint32", "ROW_MAJOR"), TensorContract("uint32", "ROW_MAJOR")),
    PROMPT_TOP_LOGPROBS: (
        _rows_out(PROMPT_TOP_LOGPROBS, "float32", "ROW_MAJOR"),
        TensorContract("float32", "ROW_MAJOR"),
    ),
}


def _entry(spec: TensorSpec) -> tuple[Callable, TensorContract]:
    try:
        return _STAGING[spec]
    except KeyError:
        raise KeyError(f"no ttnn staging for {spec!r} (known: {sorted(s.name for s in _STAGING)})") from None


def contract_of(spec: TensorSpec) -> TensorContract:
    """The dtype and layout the tensor ``spec`` has on the device."""
    return _entry(spec)[1]


def stage(spec: TensorSpec, host: torch.Tensor, mesh_mapper=None) -> Any:
    """Stages the tensor ``spec`` (see ``contract_of``) from its host value."""
    return _entry(spec)[0](host, mesh_mapper)
