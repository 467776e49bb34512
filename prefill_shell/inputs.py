"""``PrefillInputStager``: caller tensors -> host step values -> device inputs.

Host values are torch CPU tensors built per chunk from the plan and the
caller's tokens, one per ``contract.STEP_INPUTS`` entry: the token block
(zero past each prompt and for padding rows), the chunk start, the slots
(-1 for padding rows), the exact fill table and, for chunked requests, the
read table, and the chunk-relative last-token index.
"""

from __future__ import annotations

import torch

from prefill_core import PackedStep, PageTableView, PrefillChunk, PrefillRequest

from .backends.base import Backend
from .contract import (
    BODY_INPUTS,
    CHUNK_START,
    FILL_TABLE,
    INPUT_TOKENS,
    LAST_TOKEN_INDEX,
    PACKED_INPUTS,
    READ_TABLE,
    SLOTS,
    TensorSpec,
)
from .ledger import DeviceTensor, Ownership

__all__ = ["HostStep", "DeviceStep", "PrefillInputStager", "build_host_steps"]


class HostStep(dict):
    """Host values of one model-body step (one chunk of one request), keyed by ``TensorSpec``.

    ``READ_TABLE`` is present only for chunked steps; a packed step
    (``packed_inputs.py``) holds ``PACKED_INPUTS`` and its ``PackedStep``.
    """

    __slots__ = ("chunk",)

    def __init__(self, chunk: PrefillChunk | PackedStep | None, values: dict[TensorSpec, torch.Tensor]):
        dict.__init__(self, values)
        self.chunk = chunk


class DeviceStep(dict):
    """Device handles of one step, keyed by ``TensorSpec`` (``READ_TABLE`` only for chunked steps)."""

    __slots__ = ()

    def handles(self) -> list[DeviceTensor]:
        return list(self.values())


def _caller_rows(matrix: torch.Tensor, request: PrefillRequest, columns: slice) -> torch.Tensor:
    """``columns`` of the request's active rows of a caller matrix: a view when the rows are consecutive."""
    rows, active = request.source_rows, request.active_batch_size
    if rows[-1] - rows[0] == active - 1:  # contiguous caller rows (the common wave): no gather
        return matrix[rows[0] : rows[0] + active, columns]
    return matrix[torch.tensor(rows), columns]


def _padded_copy(src: torch.Tensor, rows: int, cols: int, filler: int) -> torch.Tensor:
    """A fresh ``[rows, cols]`` tensor holding ``src`` top-left and ``filler`` elsewhere, in one op.

    Never aliases ``src``: host steps outlive the call and the caller may
    reuse its tensors.
    """
    pad_rows, pad_cols = rows - src.shape[0], cols - src.shape[1]
    if pad_rows or pad_cols:
        return torch.constant_pad_nd(src, (0, pad_cols, 0, pad_rows), filler)
    return src.clone(memory_format=torch.contiguous_format)


def _token_block(tokens: torch.Tensor, request: PrefillRequest, chunk: PrefillChunk, padded_batch: int) -> torch.Tensor:
    width = min(chunk.length, tokens.shape[1] - chunk.start)
    if width <= 0:
        return torch.zeros(padded_batch, chunk.length, dtype=torch.int64)
    block = _caller_rows(tokens, request, slice(chunk.start, chunk.start + width))  # [A, width]
    if min(request.lengths) < chunk.start + width:  # some row ends inside the block: zero its tail
        positions = torch.arange(chunk.start, chunk.start + width)
        block = block.masked_fill(positions >= torch.tensor(request.lengths).unsqueeze(1), 0)
    return _padded_copy(block, padded_batch, chunk.length, 0)


def _table_tensor(rows: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    # One flat conversion is several times cheaper than a nested one.
    return torch.tensor([entry for row in rows for entry in row], dtype=torch.int32).view(len(rows), -1)


def _table_from_caller(
    page_table: torch.Tensor, view: PageTableView, request: PrefillRequest, first_block: int
) -> torch.Tensor:
    """``materialize_table``'s integers, cut from the caller's page table with tensor ops.

    Equal to the core's pure materializer by construction (a row's blocks
    are that row of the same table); tests/shell/test_staging_tables.py
    checks it on generated plans.
    """
    cols = min(view.width, page_table.shape[1] - first_block)
    real = view.real_blocks[: request.active_batch_size]
    if cols <= 0 or max(real) == 0:
        return torch.full((view.num_rows, view.width), view.filler, dtype=torch.int32)
    src = _caller_rows(page_table, request, slice(first_block, first_block + cols))  # [A, cols]
    if min(real) < cols:  # some row maps fewer blocks than the cut holds: its tail is filler
        unmapped = torch.arange(cols) >= torch.tensor(real).unsqueeze(1)
        src = src.masked_fill(unmapped, view.filler)
    if src.dtype != torch.int32:
        src = src.to(torch.int32)
    return _padded_copy(src, view.num_rows, view.width, view.filler)


def _host_step(
    tokens: torch.Tensor, request: PrefillRequest, chunk: PrefillChunk, page_table: torch.Tensor | None
) -> HostStep:
    b, active = request.padded_batch, request.active_batch_size
    pad = b - active
    if page_table is None:
        fill = _table_tensor(request.fill_table_of(chunk))
        read = None if request.read_table is None else _table_tensor(request.read_table_values())
    else:
        fill = _table_from_caller(page_table, chunk.fill_table, request, chunk.first_block)
        read = None if request.read_table is None else _table_from_caller(page_table, request.read_table, request, 0)
    # Each row's last token (position length - 1), made chunk-relative only
    # here, at the staging boundary; padding rows point at token 0 of their
    # (zero) row.
    last = [length - chunk.start - 1 for length in request.lengths] if chunk.is_final else [0] * active
    values = {
        INPUT_TOKENS: _token_block(tokens, request, chunk, b),
        CHUNK_START: torch.full((b,), chunk.start, dtype=torch.int64),
        SLOTS: torch.tensor(request.slots + (-1,) * pad, dtype=torch.int32),
        FILL_TABLE: fill,
        LAST_TOKEN_INDEX: torch.tensor(last + [0] * pad, dtype=torch.int64),
    }
    if read is not None:
        values[READ_TABLE] = read
    return HostStep(chunk, values)


def build_host_steps(
    tokens: torch.Tensor, request: PrefillRequest, page_table: torch.Tensor | None = None
) -> list[HostStep]:
    """Host values for every chunk of ``request``, in execution order.

    With the caller's ``page_table`` (the one the request was planned from)
    tables are cut from it with tensor ops; without it they come from the
    core's pure materializer. Both give the same integers.
    """
    return [_host_step(tokens, request, chunk, page_table) for chunk in request.chunks]


class PrefillInputStager:
    """Uploads host steps as invocation-owned device inputs, or refreshes persistent ones."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def stage(self, step: HostStep, acquired: list[DeviceTensor]) -> DeviceStep:
        """Allocates invocation-owned device inputs for ``step``'s body (``contract.BODY_INPUTS``).

        Each handle is appended to ``acquired`` as soon as it exists, so the
        caller's failure path releases exactly what was allocated. The
        last-token index is the postprocessor's, staged once for the final step.
        """
        handles = DeviceStep()
        for spec in (*BODY_INPUTS, *PACKED_INPUTS):
            host = step.get(spec)
            if host is not None:
                handles[spec] = self.backend.upload(host, spec, Ownership.INVOCATION)
                acquired.append(handles[spec])
        return handles

    def refresh(self, step: HostStep, persistent: DeviceStep) -> None:
        """Copies ``step``'s body inputs into a trace's persistent inputs in place (no allocation)."""
        for spec in BODY_INPUTS:
            host, target = step.get(spec), persistent.get(spec)
            if (host is None) != (target is None):
                raise AssertionError(f"step input {spec.name} does not match the trace's persistent inputs")
            if host is not None:
                self.backend.refresh(host, target)
