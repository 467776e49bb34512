"""Planned invocation sequences: ``PrefillRequest`` and its ordered ``PrefillChunk``s.

The shell handles every planned request through one protocol, which
``PrefillRequest`` (padded waves) and ``packed.PackedRequest`` (packed steps)
both implement with the same meaning: per-row tuples of the rows the request
returns (``source_rows``, ``slots``, ``lengths``, ``cached``, ``blocks``,
``sampling``), ``kind``, ``padded_batch`` (physical rows: padding included
for a wave, exactly the rows for packed steps), ``active_batch_size``,
``num_chunks`` (model-body steps), ``read_table``, ``real_tokens`` /
``computed_tokens``, and per step ``segments(i)`` (which positions of which
caller row step ``i`` computes, and where they lie in its hidden output) and
``written_blocks(i)`` (the KV blocks step ``i`` writes, per caller row).
"""

from __future__ import annotations

import enum

import attrs

from prefill_core.values.computed_positions import recomputed_positions
from prefill_core.values.sampling import SamplingParams
from prefill_core.values.tables import PageTableView, materialize_table

__all__ = ["RequestKind", "PrefillChunk", "PrefillRequest", "StepSegment"]


class RequestKind(enum.Enum):
    """The model-body variant an invocation sequence runs."""

    REGULAR_SINGLE = "regular_single"
    REGULAR_BATCHED = "regular_batched"
    CHUNKED = "chunked"
    PACKED = "packed"  # row segments laid end to end (prefill_core/planning/packed.py)

    @property
    def is_chunked(self) -> bool:
        return self is RequestKind.CHUNKED


@attrs.frozen
class StepSegment:
    """Positions ``[start, start + length)`` of caller row ``row`` that one step computes.

    They lie at ``offset`` in the step's hidden output rows (a padded wave's
    row ``b`` at ``b * chunk_length``; a packed step's segments end to end).
    ``writes``: whether the step writes any KV of the row (a fully cached
    row's re-run writes nothing: its blocks are cached and may be shared).
    Which blocks a step writes is the request's to say (``written_blocks(i)``):
    a padded wave recomputes a cached row's prefix positions without writing
    them.
    """

    row: int
    offset: int
    start: int
    length: int
    writes: bool

    @property
    def end(self) -> int:
        return self.start + self.length


@attrs.frozen
class PrefillChunk:
    """One model-body step.

    Tokens ``[start, start + length)`` of each row at absolute positions (the
    part past a row's prompt is zero padding). ``fill_table`` says which
    blocks this step writes, relative to ``first_block`` (``start //
    block_size``). Exactly one chunk of a request is final: the one
    holding every row's last token.
    """

    index: int
    start: int
    length: int
    first_block: int
    fill_table: PageTableView
    is_final: bool

    @property
    def end(self) -> int:
        return self.start + self.length


def _check_request(request: PrefillRequest) -> None:
    n = len(request.source_rows)
    per_row = (request.slots, request.lengths, request.cached, request.blocks, request.sampling)
    if n == 0 or set(map(len, per_row)) != {n}:
        raise ValueError("PrefillRequest per-row fields must be non-empty and of equal length")
    if not n <= request.padded_batch:
        raise ValueError(f"active rows {n} exceed padded_batch {request.padded_batch}")
    if any(a >= b for a, b in zip(request.source_rows, request.source_rows[1:])):
        # The staging cuts a wave's rows from the caller's matrices as a slice when they are consecutive.
        raise ValueError(f"a request's source_rows {request.source_rows} must be in caller order")
    if request.num_chunks < 1 or request.first_chunk_start % request.block_size:
        raise ValueError("a request needs >= 1 chunk starting on a block boundary")


@attrs.frozen
class PrefillRequest:
    """One invocation sequence over a padded wave.

    Per-row tuples (``source_rows``, ``slots``, ``lengths``, ``cached``,
    ``blocks``, ``sampling``) are indexed by physical row; physical rows
    ``active_batch_size .. padded_batch - 1`` are padding rows. ``blocks``
    holds the caller's page-table rows by reference (never copied).

    Chunks are stored as their arithmetic (first start, count, the two fill
    views) and built on access: every chunk of a request differs only in its
    start, so a 63-chunk request costs one value, not 63.
    """

    kind: RequestKind
    source_rows: tuple[int, ...]
    slots: tuple[int, ...]
    lengths: tuple[int, ...]
    cached: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...] = attrs.field(repr=False)
    sampling: tuple[SamplingParams | None, ...]
    padded_batch: int
    padded_length: int
    chunk_length: int
    block_size: int
    first_chunk_start: int
    num_chunks: int
    fill_table: PageTableView
    final_fill_table: PageTableView
    read_table: PageTableView | None

    def __attrs_post_init__(self):
        _check_request(self)

    @property
    def active_batch_size(self) -> int:
        return len(self.source_rows)

    @property
    def last_token_positions(self) -> tuple[int, ...]:
        """Absolute position of each active row's last token (``length - 1``)."""
        return tuple(length - 1 for length in self.lengths)

    def chunk(self, index: int) -> PrefillChunk:
        """Chunk ``index`` (negative indexes count from the end)."""
        if index < 0:
            index += self.num_chunks
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} of a {self.num_chunks}-chunk request")
        start = self.first_chunk_start + index * self.chunk_length
        final = index == self.num_chunks - 1
        fill = self.final_fill_table if final else self.fill_table
        return PrefillChunk(index, start, self.chunk_length, start // self.block_size, fill, final)

    @property
    def chunks(self) -> tuple[PrefillChunk, ...]:
        """Every chunk, in execution order; only the last is final."""
        return tuple(self.chunk(i) for i in range(self.num_chunks))

    @property
    def final_chunk(self) -> PrefillChunk:
        return self.chunk(-1)

    def fill_table_of(self, chunk: PrefillChunk) -> tuple[tuple[int, ...], ...]:
        """The exact fill (write) table the device gets for ``chunk``."""
        return materialize_table(chunk.fill_table, self.blocks, chunk.first_block)

    def read_table_values(self) -> tuple[tuple[int, ...], ...] | None:
        """The exact full-request (read) table of a chunked request, else None."""
        return None if self.read_table is None else materialize_table(self.read_table, self.blocks)

    def segments(self, index: int) -> tuple[StepSegment, ...]:
        """What chunk ``index`` computes per active row: ``[start, min(end, length))`` at hidden row ``b * length``."""
        chunk = self.chunk(index)
        rows = zip(self.source_rows, self.lengths, self.cached)
        return tuple(
            StepSegment(
                row, b * chunk.length, chunk.start, max(0, min(chunk.end, length) - chunk.start), cached < length
            )
            for b, (row, length, cached) in enumerate(rows)
        )

    def written_blocks(self, index: int) -> dict[int, tuple[int, ...]]:
        """Per active caller row, the blocks chunk ``index`` writes: its fill table's entries, in column order."""
        fills = self.fill_table_of(self.chunk(index))
        return {row: tuple(b for b in fill if b >= 0) for row, fill in zip(self.source_rows, fills)}

    @property
    def real_tokens(self) -> int:
        """Prompt tokens this request must process (a fully cached row recomputes one)."""
        return sum(max(length - cached, 1) for length, cached in zip(self.lengths, self.cached))

    @property
    def recomputed_tokens(self) -> int:
        """Positions the device computes although the cache held them (a start inside a block).

        ``computed_positions.recomputed_positions`` summed over the rows: the
        cached part of the block holding each row's cached offset, or a fully
        cached row's whole final block.
        """
        bs = self.block_size
        return sum(recomputed_positions(n, c, bs) for n, c in zip(self.lengths, self.cached))

    @property
    def computed_tokens(self) -> int:
        """Token positions the device computes, padding included."""
        return self.padded_batch * self.num_chunks * self.chunk_length
