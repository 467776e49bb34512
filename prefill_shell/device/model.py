"""The model protocol: what the runtime borrows from a model, and nothing more.

The runtime never builds a model. It calls a hidden-body step over a padded
wave of rows (regular or chunked prefill, writing paged KV) and an LM head
over the rows it picked out. Anything that implements these two calls with
the semantics below can be driven by the runtime, eagerly or under a captured
CUDA graph / ttnn trace.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs
import torch

__all__ = [
    "PACKED_CAPABILITY",
    "SEGMENT_ENDS_CAPABILITY",
    "SHARED_WRITES_CAPABILITY",
    "SegmentEndsPrefillModel",
    "SharedWritesPrefillModel",
    "GroupedPrefillModel",
    "ModelSpec",
    "PackedPrefillModel",
    "PrefillModel",
    "model_difference",
    "supports_packed",
    "supports_segment_ends",
    "supports_shared_writes",
]


def _positive_int(_instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelSpec.{attribute.name}={value!r} is invalid: must be a positive int")


@attrs.frozen
class ModelSpec:
    """Architecture facts the runtime needs to size buffers and KV pools (the dtype is ``PrefillModel.dtype``)."""

    vocab_size: int = attrs.field(validator=_positive_int)
    hidden_size: int = attrs.field(validator=_positive_int)
    num_layers: int = attrs.field(validator=_positive_int)
    num_heads: int = attrs.field(validator=_positive_int)
    num_kv_heads: int = attrs.field(validator=_positive_int)
    head_dim: int = attrs.field(validator=_positive_int)
    max_position: int = attrs.field(validator=_positive_int)


@runtime_checkable
class PrefillModel(Protocol):
    """A model body with paged KV that the prefill runtime can drive.

    ``forward_hidden`` must be capturable in a CUDA graph: no host syncs, no
    data-dependent shapes. Every varying quantity (``start``, tables) is a
    device tensor so a replay picks up new values from the same buffers.
    """

    spec: ModelSpec
    dtype: torch.dtype  # of the hidden states ``forward_hidden`` returns

    def forward_hidden(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        fill_table: torch.Tensor,
        read_table: torch.Tensor | None,
        kv: Any,
    ) -> torch.Tensor:
        """Runs the model body over one wave and writes its K/V into ``kv``.

        Args:
            tokens: int64 ``[B, S]``; ``S`` is a multiple of the KV block size.
                Padding rows and tails hold token 0.
            start: int64 ``[B]``; absolute position of ``tokens[:, 0]``
                (0 for regular prefill, the chunk start for chunked prefill).
            fill_table: int32 ``[B, Wf]``; column ``j`` is the block that
                receives positions ``start + j*bs .. start + (j+1)*bs - 1``.
                ``-1`` writes nothing. Only columns ``j < min(Wf, S // bs)``
                are used.
            read_table: ``None`` for regular prefill (plain causal attention
                over the ``S`` fresh tokens; ``start`` is 0), or int32
                ``[B, Wr]`` for chunked prefill: column ``j`` is absolute block
                ``j`` of the row, all entries non-negative (unmapped columns
                hold a filler id). ``start`` is a multiple of the block size
                and ``start + S <= Wr*bs``. Query ``i`` attends to the prefix
                ``[0, start)`` read through this table and to the chunk's own
                fresh K/V for ``[start, start + i]``; nothing else in the pool
                (filler blocks, the row's later blocks, other rows' blocks) may
                reach an output, even NaN or inf (``tests/engine/test_nonfinite_pool.py``).
                The chunk's K/V is also written through ``fill_table``.
            kv: the paged KV pool to write into and read from (the model's own
                kind, e.g. ``reference.PagedKVCache``; the runtime only passes it on).

        Returns:
            ``[B, S, hidden_size]`` after the final norm, in the model dtype.
        """
        ...

    def lm_head(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Maps ``[N, hidden_size]`` rows to float32 logits ``[N, vocab_size]``."""
        ...


PACKED_CAPABILITY = "packed_steps"
"""The optional model capability: a model with ``packed_steps = True`` also implements

``forward_packed(tokens [T], positions [T], write_slots [T], segments [G, 3],
prefix_table [G, Wp], kv) -> [1, T, hidden_size]``: one packed step
(``prefill_core.planning.packed``), its segments' tokens end to end. Segment ``g`` is
``(offset, length, start)``: tokens ``offset .. offset + length - 1`` are its
row's positions ``start ..``; their queries attend to the row's positions
before ``start`` read through ``prefix_table[g]`` (its row's blocks) and to
the segment's own fresh K/V causally, never to another segment. Token ``t``
writes its K/V at pool slot ``write_slots[t]`` (``block * bs + position % bs``),
nothing where it is -1, and every token's K/V of a layer is written before
any segment's attention of that layer reads the pool: a segment may read
through its prefix table a block another segment of the same step writes (a
same-step prefix hit, planned writer first). Eager only: shapes follow the step. Optional, so a
model without it (the ttnn adapter) stays a ``PrefillModel``; ``supports_packed``
reads it.
"""


@runtime_checkable
class PackedPrefillModel(PrefillModel, Protocol):
    """A ``PrefillModel`` that runs packed steps (``packed_steps = True``; ``PACKED_CAPABILITY`` says how)."""

    packed_steps: bool

    def forward_packed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        segments: torch.Tensor,
        prefix_table: torch.Tensor,
        kv: Any,
    ) -> torch.Tensor:
        """One packed step (``contract.PACKED_INPUTS`` in order): ``[T]`` tokens end to end -> ``[1, T, hidden]``."""
        ...


@runtime_checkable
class GroupedPrefillModel(PrefillModel, Protocol):
    """A model whose layers fall into KV groups (``prefill_core.AttentionLayout``): windowed or hybrid.

    The runtime plans its calls with the groups (``prefill_core.plan_call``)
    and hands each step every group's tables instead of one table: a padded
    step to ``forward_grouped``, a packed one to ``forward_packed_grouped``.
    ``forward_hidden`` (one table for every layer) is never called on it.
    ``new_kv_cache(num_blocks, block_size)`` keeps a buffer per layer, so one
    page table can serve every group; ``buffers=`` lays them out as vLLM plans.
    """

    attention: Any  # prefill_core.AttentionLayout

    def forward_grouped(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        fill_tables: torch.Tensor,
        read_tables: torch.Tensor | None,
        read_from: torch.Tensor,
        reused: torch.Tensor,
        kv: Any,
    ) -> torch.Tensor:
        """One padded step: ``forward_hidden``'s tokens and start with ``[G, B, W]`` tables per group
        (``contract.GROUPED_INPUTS``: fill, read, first readable column, reused span). Returns ``[B, S, hidden]``."""
        ...

    def forward_packed_grouped(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        segments: torch.Tensor,
        write_slots: torch.Tensor,
        prefix_tables: torch.Tensor,
        prefix_from: torch.Tensor,
        kv: Any,
    ) -> torch.Tensor:
        """One packed step with each group's slots and prefix tables (``contract.GROUPED_PACKED_INPUTS``).
        Returns ``[1, T, hidden]``."""
        ...


def supports_packed(model: object) -> bool:
    """Whether ``model`` declares it runs packed steps."""
    return getattr(model, PACKED_CAPABILITY, False) is True


SEGMENT_ENDS_CAPABILITY = "segment_ends"
"""The optional packed-model capability: a model with ``segment_ends = True`` also takes
``forward_packed(..., kv, ends_only=True)``, which computes only each segment's last token's row of the
``[1, T, hidden]`` output (the others are zero) while still writing every token's K/V in every layer. The
runtime asks for it where nothing reads a step's other rows: no prompt log-probs and no pooled state but LAST, so
only the last tokens the postprocessor samples from (``LAST_TOKEN_INDEX``, each row's last token, which ends a
segment) and LAST pooling reads.
The last layer then runs its attention (where the model can), ``o_proj`` and MLP for the segment ends alone."""


@runtime_checkable
class SegmentEndsPrefillModel(PackedPrefillModel, Protocol):
    """A ``PackedPrefillModel`` that computes a packed step's segment ends alone on request
    (``segment_ends = True``; ``SEGMENT_ENDS_CAPABILITY`` says how)."""

    segment_ends: bool

    def forward_packed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        segments: torch.Tensor,
        prefix_table: torch.Tensor,
        kv: Any,
        *,
        ends_only: bool = False,
    ) -> torch.Tensor:
        """``PackedPrefillModel.forward_packed``; ``ends_only``: each segment's last row only, the others zero."""
        ...


def supports_segment_ends(model: object) -> bool:
    """Whether ``model`` declares ``forward_packed(..., ends_only=True)``."""
    return supports_packed(model) and getattr(model, SEGMENT_ENDS_CAPABILITY, False) is True


SHARED_WRITES_CAPABILITY = "shared_writes"
"""The optional packed-model capability: a model with ``shared_writes = True`` also takes
``forward_packed(..., kv, shared_writes=pairs)``, ``pairs`` an ``[N, 2]`` int64 tensor of ``(token, slot)``
(``contract.PACKED_SHARED_WRITES``): in every layer, the K/V the step computes for its token ``token`` (an index
into the step's tokens) is written into pool slot ``slot`` too, before any attention of that layer reads the
pool. The runtime then plans shared spans (``prefill_core.planning.shared_spans``): a row that begins with the
same tokens as an earlier row, over the same blocks before its cached length, takes those positions' K/V this
way instead of computing them."""


@runtime_checkable
class SharedWritesPrefillModel(PackedPrefillModel, Protocol):
    """A ``PackedPrefillModel`` that writes a step's K/V into more slots on request (``shared_writes = True``;
    ``SHARED_WRITES_CAPABILITY`` says how)."""

    shared_writes: bool

    def forward_packed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        segments: torch.Tensor,
        prefix_table: torch.Tensor,
        kv: Any,
        *,
        shared_writes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``PackedPrefillModel.forward_packed``; ``shared_writes``: ``(token, slot)`` pairs also written."""
        ...


def supports_shared_writes(model: object) -> bool:
    """Whether ``model`` declares ``forward_packed(..., shared_writes=pairs)``."""
    return supports_packed(model) and getattr(model, SHARED_WRITES_CAPABILITY, False) is True


CHUNKED_WAVES_CAPABILITY = "chunked_waves"
"""The optional model capability: a model with ``chunked_waves = True`` runs a chunked step
(``read_table`` given) over several rows, each with its own row of ``start``, the fill and read
tables (``PrefillPolicy.batch_cached_rows``). TTTv2's chunked ``prefill_forward`` runs one row."""


def supports_chunked_waves(model: object) -> bool:
    """Whether ``model`` declares it runs chunked steps of several rows."""
    return getattr(model, CHUNKED_WAVES_CAPABILITY, False) is True


def model_difference(model: object, other: object) -> str | None:
    """The first spec field (or the dtype) in which ``other`` differs from ``model``, as ``"field a vs b"``;
    None when they agree. Lanes of one group must run one model: their rows are one call's rows."""
    spec, other_spec = getattr(model, "spec", None), getattr(other, "spec", None)
    if not isinstance(spec, ModelSpec) or not isinstance(other_spec, ModelSpec):
        return f"spec {type(spec).__name__} vs {type(other_spec).__name__}"
    for field in attrs.fields(ModelSpec):
        mine, theirs = getattr(spec, field.name), getattr(other_spec, field.name)
        if mine != theirs:
            return f"spec.{field.name} {mine} vs {theirs}"
    mine, theirs = getattr(model, "dtype", None), getattr(other, "dtype", None)
    return None if mine == theirs else f"dtype {mine} vs {theirs}"
