"""Helpers that read a plan through its materialized device tables.

Invariants are checked on the exact integers a device would get
(``fill_table_of`` / ``read_table_values``), never on the views.
"""

from __future__ import annotations

from collections.abc import Iterator

from prefill_core import SKIP, PrefillBatch, PrefillRequest
from prefill_core.values.computed_positions import written_columns


def written_entries(request: PrefillRequest) -> Iterator[tuple[int, int, int]]:
    """``(physical row, absolute block index, block id)`` for every non-skip fill-table entry."""
    for chunk in request.chunks:
        table = request.fill_table_of(chunk)
        for physical, entries in enumerate(table):
            for column, block in enumerate(entries):
                if block != SKIP:
                    yield physical, chunk.first_block + column, block


def writes_by_source_row(requests: tuple[PrefillRequest, ...]) -> dict[int, list[tuple[int, int]]]:
    """Caller row -> every ``(absolute block index, block id)`` its chunks write, in order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for request in requests:
        for row in request.source_rows:
            out.setdefault(row, [])
        for physical, index, block in written_entries(request):
            out[request.source_rows[physical]].append((index, block))
    return out


def expected_writes(batch: PrefillBatch, block_size: int) -> dict[int, list[tuple[int, int]]]:
    """What each row must write: its mapped blocks from the one holding the cached offset to its last block."""
    return {
        i: [(j, row.blocks[j]) for j in written_columns(row.length, row.cached, block_size)]
        for i, row in enumerate(batch.rows)
    }


def source_of(requests: tuple[PrefillRequest, ...]) -> dict[int, tuple[PrefillRequest, int]]:
    """Caller row -> (its request, its physical row in that request)."""
    return {row: (request, physical) for request in requests for physical, row in enumerate(request.source_rows)}
