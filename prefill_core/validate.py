"""Rules a batch must satisfy against a layout and policy (beyond its own).

Each check raises a named ``PrefillInputError`` subclass whose message names
the row, the field, the value and the rule; nothing is planned on failure.
The block checks use C-level builtins (min, max, set) so their cost grows
with mapped blocks at a small constant, never with tokens.
"""

from __future__ import annotations

from array import array

from .batch import PrefillBatch, PrefillRow
from .errors import (
    BlockConflictError,
    CapacityError,
    InvalidCachedLengthError,
    InvalidPageTableError,
    InvalidSlotError,
    PrefillInputError,
    row_error,
)
from .layout import PageTableLayout
from .policy import PrefillPolicy, check_policy_fits_layout
from .sampling import check_sampling

__all__ = ["check_inputs", "written_block_range"]


def written_block_range(row: PrefillRow, block_size: int) -> tuple[int, int]:
    """Columns ``[lo, hi)`` of the row's page table that prefill writes."""
    return row.cached // block_size, -(-row.length // block_size)


def _check_arguments(batch: object, policy: object, layout: object) -> None:
    for name, value, kind in (("batch", batch, PrefillBatch), ("policy", policy, PrefillPolicy), ("layout", layout, PageTableLayout)):
        if not isinstance(value, kind):
            msg = f"{name} must be a {kind.__name__}, got {type(value).__name__}"
            raise PrefillInputError(msg, field=name)


def _long_prefix_in_pool(prefix: tuple[int, ...], num_blocks: int) -> bool:
    # array("I") rejects negative ids in C: about twice as fast as min() on
    # thousands of ids (and slower than min() on a handful).
    try:
        array("I", prefix)
    except OverflowError:
        return False
    return max(prefix) < num_blocks


def _raise_row_rule(index: int, row: PrefillRow, policy: PrefillPolicy, layout: PageTableLayout) -> None:
    """Slow path: names the first rule ``row`` breaks (the fast loop only detects one)."""
    bs = layout.block_size
    if row.cached % bs:
        raise row_error(InvalidCachedLengthError, index, "cached", row.cached, f"must be a multiple of block_size={bs}")
    if row.slot >= policy.lane_size:
        raise row_error(InvalidSlotError, index, "slot", row.slot, f"must be < lane_size={policy.lane_size}")
    if row.length > layout.capacity:
        rule = f"must be <= the layout's capacity {layout.capacity} (block_size * max_num_blocks_per_seq)"
        raise row_error(CapacityError, index, "length", row.length, rule)
    need = layout.blocks_for(row.length)
    if len(row.blocks) < need:
        rule = f"the mapped prefix needs ceil(length={row.length} / block_size={bs}) = {need} entries"
        raise row_error(InvalidPageTableError, index, "blocks", f"<{len(row.blocks)} entries>", rule)
    prefix = row.blocks[:need]
    column = next(j for j, b in enumerate(prefix) if not 0 <= b < layout.num_blocks)
    rule = f"mapped entries must be block ids in [0, num_blocks={layout.num_blocks})"
    raise row_error(InvalidPageTableError, index, f"blocks[{column}]", prefix[column], rule)


def _check_rows(batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout) -> None:
    # The hot loop of planning: locals and inline checks, one pass per row.
    bs, lane, capacity, pool = layout.block_size, policy.lane_size, layout.capacity, layout.num_blocks
    for index, row in enumerate(batch.rows):
        length, blocks = row.length, row.blocks
        need = -(-length // bs)
        if row.cached % bs or row.slot >= lane or length > capacity or len(blocks) < need:
            _raise_row_rule(index, row, policy, layout)
        prefix = blocks if len(blocks) == need else blocks[:need]
        if need > 64:
            in_pool = _long_prefix_in_pool(prefix, pool)
        else:
            in_pool = min(prefix) >= 0 and max(prefix) < pool
        if not in_pool:
            _raise_row_rule(index, row, policy, layout)
        if row.sampling is not None:
            check_sampling(index, row.sampling, policy.max_logprobs)


def _locate_conflict(batch: PrefillBatch, block_size: int) -> None:
    """Slow path, run only once a conflict is known: finds and raises it."""
    writer: dict[int, int] = {}
    for index, row in enumerate(batch.rows):
        lo, hi = written_block_range(row, block_size)
        own: set[int] = set()
        for column in range(lo, hi):
            block = row.blocks[column]
            other = writer.setdefault(block, index)
            if other == index and block not in own:
                own.add(block)
                continue
            if other == index:
                rule = "the row writes this block at two positions; a block holds one run of positions"
            else:
                rule = f"block {block} is also written by row {other}; one block takes one writer"
            raise row_error(BlockConflictError, index, f"blocks[{column}]", block, rule)
    for index, row in enumerate(batch.rows):
        for column in range(row.cached // block_size):
            other = writer.get(row.blocks[column])
            if other is not None:
                rule = f"this cached block would be overwritten by row {other}"
                raise row_error(BlockConflictError, index, f"blocks[{column}]", row.blocks[column], rule)
    raise AssertionError("a conflict was detected but not located")


def _check_block_conflicts(batch: PrefillBatch, block_size: int) -> None:
    """No block is written twice, and no written block is another read's cached prefix.

    Cached-prefix blocks may be shared between rows: they are only read.
    """
    written: set[int] = set()
    num_written = 0
    cached: list[int] = []
    for row in batch.rows:
        lo, hi = row.cached // block_size, -(-row.length // block_size)  # written_block_range, inlined
        written.update(row.blocks[lo:hi])
        num_written += hi - lo
        if lo:
            cached += row.blocks[:lo]
    if len(written) != num_written or not written.isdisjoint(cached):
        _locate_conflict(batch, block_size)


def check_inputs(batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout) -> None:
    """Raises the first broken rule as a ``PrefillInputError`` subclass."""
    _check_arguments(batch, policy, layout)
    check_policy_fits_layout(policy, layout)
    _check_rows(batch, policy, layout)
    _check_block_conflicts(batch, layout.block_size)
