"""Writer before reader: the run order of a call whose rows read blocks other rows of it write.

vLLM's prefix cache registers a full block when it allocates it, before the
step that fills it has run, so within one step a later request may map as
cached a block an earlier request of the same step is still writing (vLLM's
own flattened pass writes each layer's KV before any attention reads it).
Here requests run one after another, so the call is served by running every
request that writes such a block before every request that reads it.

The rule table (``rules.RULES``, rule "a block read as cached is written
whole at its column") admits such a pair only when the writer fills the
whole block at the column where the reader reads it. With that rule a cycle
cannot come out of the planner: a reader's cached columns lie before its
first written column and a writer's written ones at or after it, so two rows
reading each other's blocks would need a column both before and after the
other. ``order_writers_first`` still checks, because it takes any requests.
"""

from __future__ import annotations

from prefill_core.inputs.batch import PrefillBatch
from prefill_core.planning.request import PrefillRequest
from prefill_core.values.computed_positions import written_columns
from prefill_core.values.errors import BlockDependencyCycleError
from prefill_core.values.intmath import ceil_div

__all__ = [
    "order_by_dependencies",
    "order_writers_first",
    "request_dependencies",
    "row_dependencies",
    "rows_writers_first",
]


def _row_reads_and_writes(length: int, cached: int, blocks: tuple[int, ...], block_size: int):
    """Block ids one row reads as cached and block ids it writes."""
    mapped = blocks[: ceil_div(length, block_size)]
    written = written_columns(length, cached, block_size)
    first_written = written.start if written else len(mapped)
    return mapped[:first_written], mapped[first_written:]


def _reads_and_writes(request: PrefillRequest, block_size: int) -> tuple[set[int], set[int]]:
    """Block ids the request reads as cached and block ids it writes."""
    reads: set[int] = set()
    writes: set[int] = set()
    for length, cached, blocks in zip(request.lengths, request.cached, request.blocks):
        row_reads, row_writes = _row_reads_and_writes(length, cached, blocks, block_size)
        reads.update(row_reads)
        writes.update(row_writes)
    return reads, writes


def row_dependencies(batch: PrefillBatch, block_size: int) -> list[set[int]]:
    """For each row of ``batch``, the other rows that write a block it reads as cached."""
    if len(batch) < 2 or not any(batch.cached):  # no other row to depend on, or nothing read as cached
        return [set() for _ in range(len(batch))]
    sides = [
        _row_reads_and_writes(length, cached, blocks, block_size)
        for length, cached, blocks in zip(batch.lengths, batch.cached, batch.blocks)
    ]
    writer_of = {block: row for row, (_, writes) in enumerate(sides) for block in writes}
    return [{writer_of[b] for b in reads if b in writer_of} - {row} for row, (reads, _) in enumerate(sides)]


def request_dependencies(requests: tuple[PrefillRequest, ...], block_size: int) -> list[set[int]]:
    """For each request, the indices of the other requests that write a block it reads as cached."""
    # One request has no other to depend on; with nothing read as cached there is no order to keep.
    if len(requests) < 2 or not any(any(request.cached) for request in requests):
        return [set() for _ in requests]
    sides = [_reads_and_writes(request, block_size) for request in requests]
    writer_of = {block: index for index, (_, writes) in enumerate(sides) for block in writes}
    return [
        {writer_of[block] for block in reads if block in writer_of} - {index} for index, (reads, _) in enumerate(sides)
    ]


def order_writers_first(requests: tuple[PrefillRequest, ...], block_size: int) -> tuple[PrefillRequest, ...]:
    """``requests`` with each one after every request that writes a block it reads; otherwise in order.

    Stable: among requests whose writers have all run, the earliest in
    ``requests`` goes next, so a call without such pairs keeps its order.
    Raises ``BlockDependencyCycleError`` when no order serves every request.
    """
    if len(requests) < 2:  # nothing to order
        return requests
    return order_by_dependencies(requests, request_dependencies(requests, block_size))


def order_by_dependencies(requests: tuple[PrefillRequest, ...], needs: list[set[int]]) -> tuple[PrefillRequest, ...]:
    """``requests`` with request i after every request in ``needs[i]``; otherwise in order (stable).

    Raises ``BlockDependencyCycleError`` when no order serves every request.
    """
    if not any(needs):
        return requests
    ordered = _first_ready_order(needs)
    if len(ordered) < len(requests):
        raise _cycle_error(requests, needs, set(ordered))
    return tuple(requests[i] for i in ordered)


def rows_writers_first(batch: PrefillBatch, block_size: int) -> tuple[int, ...]:
    """``batch``'s rows with each after every row that writes a block it reads; otherwise in caller order.

    Packed steps (``packed.py``) lay rows end to end in this order, so a
    row's segments never precede its writers' last segment. Raises
    ``BlockDependencyCycleError`` when no order serves every row.
    """
    needs = row_dependencies(batch, block_size)
    if not any(needs):
        return tuple(range(len(needs)))
    ordered = _first_ready_order(needs)
    if len(ordered) < len(needs):
        row = next(r for r in range(len(needs)) if r not in set(ordered))
        others = sorted(needs[row] - set(ordered))
        msg = (
            f"row {row}: blocks is invalid: it reads as cached a block that rows {others} write, "
            "and they read a block it (or a row waiting on it) writes: no run order serves both"
        )
        raise BlockDependencyCycleError(msg, row=row, field="blocks")
    return tuple(ordered)


def _first_ready_order(needs: list[set[int]]) -> list[int]:
    """Indices in order, each once everything it needs is placed (earliest first); stops at a cycle."""
    ordered: list[int] = []
    done: set[int] = set()
    while len(ordered) < len(needs):
        ready = next((i for i in range(len(needs)) if i not in done and needs[i] <= done), None)
        if ready is None:
            break
        ordered.append(ready)
        done.add(ready)
    return ordered


def _cycle_error(
    requests: tuple[PrefillRequest, ...], needs: list[set[int]], done: set[int]
) -> BlockDependencyCycleError:
    waiting = [i for i in range(len(requests)) if i not in done]
    first = requests[waiting[0]]
    others = sorted({row for i in needs[waiting[0]] - done for row in requests[i].source_rows})
    msg = (
        f"row {first.source_rows[0]}: blocks is invalid: it reads as cached a block that rows {others} write, "
        "and they read a block it (or a row waiting on it) writes: no run order serves both"
    )
    return BlockDependencyCycleError(msg, row=first.source_rows[0], field="blocks")
