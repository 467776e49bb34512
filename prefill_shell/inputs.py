"""``PrefillInputStager``: caller tensors -> host step values -> device inputs.

Host values are torch CPU tensors built per chunk from the plan and the
caller's tokens: tokens ``[B, S]`` (int64; zero past each prompt and for
padding rows), ``start [B]``, ``slots [B]`` (-1 for padding rows), the exact
fill table ``[B, Wf]`` and, for chunked requests, the read table ``[B, Wr]``
(int32), and the chunk-relative last-token index ``[B]``.
"""

from __future__ import annotations

import torch

from prefill_core import PageTableView, PrefillChunk, PrefillRequest

from .backends.base import Backend
from .ledger import DeviceTensor, Ownership

__all__ = ["HostStep", "DeviceStep", "PrefillInputStager", "build_host_steps"]

BODY_FIELDS = ("tokens", "start", "slots", "fill_table", "read_table")
STEP_FIELDS = (*BODY_FIELDS, "last_index")


class HostStep:
    """Host values of one model-body step (one chunk of one request)."""

    __slots__ = ("chunk", *STEP_FIELDS)

    def __init__(self, chunk: PrefillChunk, tokens, start, slots, fill_table, read_table, last_index):
        self.chunk = chunk
        self.tokens = tokens  # [B, S] int64
        self.start = start  # [B] int64
        self.slots = slots  # [B] int32
        self.fill_table = fill_table  # [B, Wf] int32
        self.read_table = read_table  # [B, Wr] int32 or None
        self.last_index = last_index  # [B] int64, chunk-relative


class DeviceStep:
    """Device handles of one step, in ``STEP_FIELDS`` order (``read_table`` may be None)."""

    __slots__ = STEP_FIELDS

    def __init__(self, handles: dict[str, DeviceTensor | None]):
        for name in STEP_FIELDS:
            setattr(self, name, handles.get(name))

    def handles(self) -> list[DeviceTensor]:
        return [h for h in (getattr(self, n) for n in STEP_FIELDS) if h is not None]


def _token_block(tokens: torch.Tensor, request: PrefillRequest, chunk: PrefillChunk, padded_batch: int) -> torch.Tensor:
    out = torch.zeros(padded_batch, chunk.length, dtype=torch.int64)
    width = min(chunk.length, tokens.shape[1] - chunk.start)
    if width <= 0:
        return out
    rows, active = request.source_rows, request.active_batch_size
    if rows[-1] - rows[0] == active - 1:  # contiguous caller rows (the common wave): a view, no gather
        block = tokens[rows[0] : rows[0] + active, chunk.start : chunk.start + width]  # [A, width]
    else:
        block = tokens[torch.tensor(rows), chunk.start : chunk.start + width]
    if min(request.lengths) < chunk.start + width:  # some row ends inside the block: zero its tail
        positions = torch.arange(chunk.start, chunk.start + width)
        block = block.masked_fill(positions >= torch.tensor(request.lengths).unsqueeze(1), 0)
    out[:active, :width] = block
    return out


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
    out = torch.full((view.num_rows, view.width), view.filler, dtype=torch.int32)
    active = request.active_batch_size
    cols = min(view.width, page_table.shape[1] - first_block)
    real = view.real_blocks[:active]
    if cols > 0 and max(real) > 0:
        rows = request.source_rows
        if rows[-1] - rows[0] == active - 1:
            src = page_table[rows[0] : rows[0] + active, first_block : first_block + cols]
        else:
            src = page_table[torch.tensor(rows), first_block : first_block + cols]
        unmapped = torch.arange(cols) >= torch.tensor(real).unsqueeze(1)  # [A, cols]
        out[:active, :cols] = src.to(torch.int32).masked_fill(unmapped, view.filler)
    return out


def _host_step(
    tokens: torch.Tensor, request: PrefillRequest, chunk: PrefillChunk, page_table: torch.Tensor | None
) -> HostStep:
    b, active = request.padded_batch, request.active_batch_size
    pad = b - active
    start = torch.full((b,), chunk.start, dtype=torch.int64)
    slots = torch.tensor(request.slots + (-1,) * pad, dtype=torch.int32)
    if page_table is None:
        fill = _table_tensor(request.fill_table_of(chunk))
        read = None if request.read_table is None else _table_tensor(request.read_table_values())
    else:
        fill = _table_from_caller(page_table, chunk.fill_table, request, chunk.first_block)
        read = None if request.read_table is None else _table_from_caller(page_table, request.read_table, request, 0)
    # Made chunk-relative only here, at the staging boundary; padding rows
    # point at token 0 of their (zero) row.
    last = [p - chunk.start for p in request.last_token_positions] if chunk.is_final else [0] * active
    last_index = torch.tensor(last + [0] * pad, dtype=torch.int64)
    return HostStep(chunk, _token_block(tokens, request, chunk, b), start, slots, fill, read, last_index)


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
        """Allocates invocation-owned device inputs for ``step``.

        Each handle is appended to ``acquired`` as soon as it exists, so the
        caller's failure path releases exactly what was allocated.
        """
        handles: dict[str, DeviceTensor | None] = {}
        for name in STEP_FIELDS:
            host = getattr(step, name)
            if host is not None:
                handles[name] = self.backend.upload(host, name, Ownership.INVOCATION)
                acquired.append(handles[name])
        return DeviceStep(handles)

    def refresh(self, step: HostStep, persistent: DeviceStep) -> None:
        """Copies ``step``'s body inputs into a trace's persistent inputs in place (no allocation)."""
        for name in BODY_FIELDS:
            host, target = getattr(step, name), getattr(persistent, name)
            if (host is None) != (target is None):
                raise AssertionError(f"step field {name} does not match the capture schema")
            if host is not None:
                self.backend.refresh(host, target)
