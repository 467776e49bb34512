"""``PrefillInputStager``: caller tensors -> host step values -> device inputs.

Host values are torch CPU tensors built from the plan and the caller's
tokens and page table, one per ``contract.STEP_INPUTS`` entry: the token
block (zero past each prompt and for padding rows), the chunk start, the
slots (-1 for padding rows), the exact fill table and, for chunked
requests, the read table, and the chunk-relative last-token index.

A chunked request's tensors are built once for the whole row (its tokens
from the first chunk start on, every chunk's fill table as one matrix, the
read table, the slot) and each chunk's step values are views into them,
taken when the step is read: a 131072-token row is 63 chunks at 2048, and
per-chunk tensors cost more than the rest of its prepare together
(``benchmarks/vs_tt_metal_planner.py``, case ``131072_cached_2048``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefill_core import SKIP, PageTableView, PrefillRequest, RequestKind
from prefill_shell.backends.base import Backend
from prefill_shell.device.contract import (
    BODY_INPUTS,
    CHUNK_START,
    FILL_TABLE,
    GROUP_PACKED_TABLES,
    INPUT_TOKENS,
    LAST_TOKEN_INDEX,
    PACKED_INPUTS,
    PACKED_SHARED_WRITES,
    READ_TABLE,
    SLOTS,
    TensorSpec,
)
from prefill_shell.device.ledger import DeviceTensor, Ownership

__all__ = ["HostStep", "DeviceStep", "PrefillInputStager", "build_host_steps"]


class HostStep(dict):
    """Host values of one model-body step (step ``index`` of its request), keyed by ``TensorSpec``.

    ``kind`` is the request's variant, which says which model body runs the
    step: ``BODY_INPUTS`` for a padded wave (``READ_TABLE`` only for chunked
    steps), ``PACKED_INPUTS`` for a packed step (``packed_inputs.py``).
    ``index`` is ``None`` for a warm-up step, which belongs to no request.
    """

    __slots__ = ("index", "kind")

    def __init__(self, index: int | None, values: dict[TensorSpec, torch.Tensor], kind: RequestKind):
        dict.__init__(self, values)
        self.index = index
        self.kind = kind


class DeviceStep(dict):
    """Device handles of one step, keyed by ``TensorSpec``; ``kind``: its host step's (which body runs it)."""

    __slots__ = ("kind",)

    def __init__(self, kind: RequestKind):
        dict.__init__(self)
        self.kind = kind

    def handles(self) -> list[DeviceTensor]:
        return list(self.values())


def _row_index(request: PrefillRequest) -> torch.Tensor | None:
    """The request's caller rows as an index tensor, or ``None`` when they are consecutive (sliced, no gather)."""
    rows = request.source_rows
    if rows[-1] - rows[0] == len(rows) - 1:
        return None
    return torch.tensor(rows, dtype=torch.int64)  # a dtype given: torch skips inferring one per element


def _caller_rows(
    matrix: torch.Tensor, request: PrefillRequest, columns: slice, index: torch.Tensor | None
) -> torch.Tensor:
    """``columns`` of the request's active rows of a caller matrix (``index``: ``_row_index``'s).

    Consecutive rows are a view, or the matrix itself when they are all of
    it: callers copy before they write.
    """
    if index is not None:
        return matrix[:, columns].index_select(0, index)  # a row gather
    first, active = request.source_rows[0], request.active_batch_size
    num_rows, num_columns = matrix.shape
    if active == num_rows and columns.start == 0 and columns.stop >= num_columns:
        return matrix
    return matrix[first : first + active, columns]


def _padded_copy(src: torch.Tensor, rows: int, cols: int, filler: int) -> torch.Tensor:
    """A fresh ``[rows, cols]`` tensor holding ``src`` top-left and ``filler`` elsewhere, in one op.

    Never aliases ``src``: host steps outlive the call and the caller may
    reuse its tensors.
    """
    src_rows, src_cols = src.shape
    if src_rows != rows or src_cols != cols:
        return torch.constant_pad_nd(src, (0, cols - src_cols, 0, rows - src_rows), filler)
    return src.clone(memory_format=torch.contiguous_format)


def _column(values: Sequence[int]) -> torch.Tensor:
    """``values`` as a ``[len, 1]`` int64 tensor, to compare against a row of column numbers."""
    return torch.tensor(values, dtype=torch.int64).unsqueeze(1)


def _table_from_caller(
    page_table: torch.Tensor,
    view: PageTableView,
    request: PrefillRequest,
    first_block: int,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``materialize_table``'s integers, cut from the caller's page table with tensor ops.

    Equal to the core's pure materializer by construction (a row's blocks
    are that row of the same table); tests/engine/steps/test_inputs.py
    checks it on generated plans. ``index``: the request's ``_row_index``.
    """
    cols = min(view.width, page_table.shape[1] - first_block)
    real = view.real_blocks[: request.active_batch_size]
    if cols <= 0 or max(real) == 0:
        return torch.full((view.num_rows, view.width), view.filler, dtype=torch.int32)
    src = _caller_rows(page_table, request, slice(first_block, first_block + cols), index)  # [A, cols]
    if min(real) < cols:  # some row maps fewer blocks than the cut holds: its tail is filler
        src = src.masked_fill(torch.arange(cols) >= _column(real), view.filler)
    if src.dtype != torch.int32:
        src = src.to(torch.int32)
    return _padded_copy(src, view.num_rows, view.width, view.filler)


def _request_table(request: PrefillRequest) -> torch.Tensor:
    """A caller-shaped page table holding the request's rows (at their caller rows) from the core's block ids."""
    width = max(1, *(len(blocks) for blocks in request.blocks))
    table = torch.full((max(request.source_rows) + 1, width), SKIP, dtype=torch.int32)
    for row, blocks in zip(request.source_rows, request.blocks):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return table


def _wave_step(tokens: torch.Tensor, request: PrefillRequest, page_table: torch.Tensor) -> HostStep:
    """The one step of a regular request: rows padded to the wave, tokens ``[0, padded_length)``."""
    chunk = request.chunk(0)
    b, active, length = request.padded_batch, request.active_batch_size, request.chunk_length
    index = _row_index(request)  # one gather index for the token and table cuts
    width = min(length, tokens.shape[1])
    block = _caller_rows(tokens, request, slice(0, width), index)  # [active, width], maybe the caller's
    if min(request.lengths) < width:  # some row ends inside the block: its tail is zero (where() copies)
        block = torch.where(torch.arange(width) < _column(request.lengths), block, 0)
        if block.shape != (b, length):
            block = torch.constant_pad_nd(block, (0, length - width, 0, b - active), 0)
    else:
        block = _padded_copy(block, b, length, 0)  # [B, length], our copy
    pad = b - active
    values = {
        INPUT_TOKENS: block,
        CHUNK_START: torch.zeros(b, dtype=torch.int64),
        SLOTS: torch.tensor(request.slots + (-1,) * pad, dtype=torch.int32),
        FILL_TABLE: _table_from_caller(page_table, chunk.fill_table, request, 0, index),
        # Each row's last token (position length - 1); padding rows point at token 0 of their (zero) row.
        LAST_TOKEN_INDEX: torch.tensor([n - 1 for n in request.lengths] + [0] * pad, dtype=torch.int64),
    }
    return HostStep(0, values, request.kind)


def _chunked_wave_step(tokens: torch.Tensor, request: PrefillRequest, page_table: torch.Tensor) -> HostStep:
    """The one step of a chunked wave (cached rows sharing a start): each row's tokens from the start on.

    Every row reads its prefix through its row of the read table and writes
    from the start's block on (its final fill row); padding rows read filler
    and write nothing.
    """
    chunk = request.chunk(0)
    b, active, start, length = request.padded_batch, request.active_batch_size, chunk.start, chunk.length
    index = _row_index(request)
    stop = min(start + length, tokens.shape[1])
    block = _caller_rows(tokens, request, slice(start, stop), index)  # [active, stop - start]
    block = torch.where(torch.arange(start, stop) < _column(request.lengths), block, 0)  # zero past each prompt
    block = torch.constant_pad_nd(block, (0, length - (stop - start), 0, b - active), 0)  # [B, length]
    pad = b - active
    values = {
        INPUT_TOKENS: block,
        CHUNK_START: torch.full((b,), start, dtype=torch.int64),
        SLOTS: torch.tensor(request.slots + (-1,) * pad, dtype=torch.int32),
        FILL_TABLE: _table_from_caller(page_table, chunk.fill_table, request, chunk.first_block, index),
        LAST_TOKEN_INDEX: torch.tensor([n - 1 - start for n in request.lengths] + [0] * pad, dtype=torch.int64),
        READ_TABLE: _table_from_caller(page_table, request.read_table, request, 0, index),
    }
    return HostStep(0, values, request.kind)


class ChunkedSteps(Sequence):
    """A chunked request's host steps: the row's tensors built once, each step's values views into them.

    ``steps[i]`` is chunk i's ``HostStep``, made when read (views only, no
    copy); the tensors it views are built here, at prepare.
    """

    def __init__(self, tokens: torch.Tensor, request: PrefillRequest, page_table: torch.Tensor):
        self.request = request
        row, length = request.source_rows[0], request.lengths[0]
        first, chunk, count = request.first_chunk_start, request.chunk_length, request.num_chunks
        # The row's tokens from the first chunk start to the last chunk's end, zero past the prompt.
        prompt = tokens[row : row + 1, first:length]
        self.tokens = torch.constant_pad_nd(prompt, (0, count * chunk - prompt.shape[1]), 0)
        self.starts = torch.arange(first, first + count * chunk, chunk, dtype=torch.int64)
        self.slots = torch.tensor(request.slots, dtype=torch.int32)
        self.read = _table_from_caller(page_table, request.read_table, request, 0)
        self.fills = self._fill_tables(page_table)
        # Chunk-relative index of the last token in the final chunk; 0 in the others (not read there).
        self.last = torch.tensor([length - first - (count - 1) * chunk - 1], dtype=torch.int64)
        self.not_last = torch.zeros(1, dtype=torch.int64)

    def _fill_tables(self, page_table: torch.Tensor) -> torch.Tensor:
        """Every chunk's fill table as one ``[chunks, width]`` matrix, from one cut of the caller's row.

        Chunk i writes the ``chunk // bs`` blocks from its first block on;
        the final chunk the blocks up to the row's end (none when the row is
        fully cached); every other column is ``SKIP``.
        """
        request = self.request
        per_chunk = request.chunk_length // request.block_size
        first_block = request.first_chunk_start // request.block_size
        written = (request.num_chunks - 1) * per_chunk + request.final_fill_table.real_blocks[0]
        row = request.source_rows[0]
        blocks = page_table[row : row + 1, first_block : first_block + written].to(torch.int32)
        grid = torch.constant_pad_nd(blocks, (0, request.num_chunks * per_chunk - written), SKIP)
        grid = grid.view(request.num_chunks, per_chunk)
        return torch.constant_pad_nd(grid, (0, request.fill_table.width - per_chunk), SKIP)

    def __len__(self) -> int:
        return self.request.num_chunks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        chunk = self.request.chunk(index)  # IndexError past either end, negative indexes from the end
        offset = chunk.start - self.request.first_chunk_start
        values = {
            INPUT_TOKENS: self.tokens[:, offset : offset + chunk.length],
            CHUNK_START: self.starts[chunk.index : chunk.index + 1],
            SLOTS: self.slots,
            FILL_TABLE: self.fills[chunk.index : chunk.index + 1],
            LAST_TOKEN_INDEX: self.last if chunk.is_final else self.not_last,
            READ_TABLE: self.read,
        }
        return HostStep(chunk.index, values, self.request.kind)


def build_host_steps(
    tokens: torch.Tensor, request: PrefillRequest, page_table: torch.Tensor | None = None
) -> Sequence[HostStep]:
    """Host values for every chunk of ``request``, in execution order.

    ``page_table`` is the caller's table the request was planned from
    (tables are cut from it with tensor ops); without it, one is made from
    the request's block ids (the same integers).
    """
    table = _request_table(request) if page_table is None else page_table
    if request.kind.is_chunked and request.padded_batch > 1:
        return [_chunked_wave_step(tokens, request, table)]
    if request.kind.is_chunked:
        return ChunkedSteps(tokens, request, table)
    return [_wave_step(tokens, request, table)]


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
        handles = DeviceStep(step.kind)
        for spec in (*BODY_INPUTS, *PACKED_INPUTS, PACKED_SHARED_WRITES, *GROUP_PACKED_TABLES):
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
