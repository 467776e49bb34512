"""Rules a batch must satisfy against a layout and policy (beyond its own).

Each check raises a named ``PrefillInputError`` subclass whose message names
the row, the field, the value and the rule; nothing is planned on failure.
The block checks use C-level builtins (min, max, set) so their cost grows
with mapped blocks at a small constant, never with tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain, repeat
from operator import getitem, lt, mod

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


def _raise_row_rule(index: int, row: PrefillRow, policy: PrefillPolicy, layout: PageTableLayout) -> None:
    """Names the first layout or policy rule ``row`` breaks, if any."""
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
    for column, block in enumerate(row.blocks[:need]):
        if not 0 <= block < layout.num_blocks:
            rule = f"mapped entries must be block ids in [0, num_blocks={layout.num_blocks})"
            raise row_error(InvalidPageTableError, index, f"blocks[{column}]", block, rule)


def _raise_first_row_rule(batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout) -> None:
    """Slow path, run once a column pass failed: names the first broken rule in row order."""
    for index, row in enumerate(batch.rows):
        _raise_row_rule(index, row, policy, layout)
        if row.sampling is not None:
            check_sampling(index, row.sampling, policy.max_logprobs)
    raise AssertionError("a column check failed but no row breaks a rule")


def _in_pool(ids: Sequence[int], num_blocks: int) -> bool:
    """Every id lies in ``[0, num_blocks)``, checked with C-level passes only."""
    n = len(ids)
    if n <= 64:
        return min(ids) >= 0 and max(ids) < num_blocks
    if ids[0] <= ids[n // 4] <= ids[n // 2] <= ids[3 * n // 4] <= ids[-1]:
        # Looks ascending, as a paged allocator's runs are. Timsort confirms an
        # ascending run in one pass of specialised int compares, about 3x
        # cheaper than max() plus a negativity check; a table that only looked
        # ascending still gets the exact bounds, at sorting cost.
        ordered = sorted(ids)
        return ordered[0] >= 0 and ordered[-1] < num_blocks
    # array("I") rejects negative ids in C: about twice as fast as min().
    try:
        array("I", ids)
    except OverflowError:
        return False
    return max(ids) < num_blocks


def _check_rows(batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout) -> tuple[list[int], Sequence[int]]:
    """Every layout and policy row rule as column passes.

    Returns each row's mapped block count and all mapped prefixes,
    concatenated in row order.
    """
    bs, blocks, lengths, cached = layout.block_size, batch.blocks, batch.lengths, batch.cached
    n, longest = len(lengths), max(lengths)
    if max(batch.slots) >= policy.lane_size or longest > layout.capacity:
        _raise_first_row_rule(batch, policy, layout)
    if any(cached) and any(map(mod, cached, repeat(bs))):
        _raise_first_row_rule(batch, policy, layout)
    # One length (a uniform wave) needs one division, not one per row.
    needs = [-(-longest // bs)] * n if lengths == (longest,) * n else [-(-length // bs) for length in lengths]
    have = list(map(len, blocks))
    if have == needs:  # rows cut to their mapped prefix (the shell's)
        mapped = blocks[0] if n == 1 else list(chain.from_iterable(blocks))
    elif any(map(lt, have, needs)):
        _raise_first_row_rule(batch, policy, layout)
    elif n == 1:
        mapped = blocks[0][: needs[0]]
    else:
        mapped = list(chain.from_iterable(map(getitem, blocks, map(slice, needs))))
    if not _in_pool(mapped, layout.num_blocks):
        _raise_first_row_rule(batch, policy, layout)
    sampling = batch.sampling
    if sampling != (None,) * n:  # tuple equality: identity first, so all-None costs one C pass
        checked: set[int] = set()  # rows usually share one SamplingParams object: check it once
        for index, params in enumerate(sampling):
            if params is not None and id(params) not in checked:
                check_sampling(index, params, policy.max_logprobs)
                checked.add(id(params))
    return needs, mapped


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


def _check_block_conflicts(batch: PrefillBatch, block_size: int, needs: list[int], mapped: Sequence[int]) -> None:
    """No block is written twice, and no written block is another read's cached prefix.

    Cached-prefix blocks may be shared between rows: they are only read.
    """
    nothing_cached = not any(batch.cached)
    if nothing_cached or len(needs) == 1:
        # A wave with nothing cached, or one row: when no id appears twice among
        # the mapped blocks, none is written twice or over a cached block. One
        # C pass. (Rows sharing a cached prefix repeat ids legally; they take
        # the written-set path below.)
        if len(set(mapped)) == len(mapped):
            return
        if nothing_cached:  # every mapped block is written: a repeat is a conflict
            _locate_conflict(batch, block_size)
    written: set[int] = set()
    num_written = 0
    cached: list[int] = []
    for c, hi, row_blocks in zip(batch.cached, needs, batch.blocks):
        lo = c // block_size  # written_block_range, inlined
        written.update(row_blocks[lo:hi])
        num_written += hi - lo
        if lo:
            cached += row_blocks[:lo]
    if len(written) != num_written or not written.isdisjoint(cached):
        _locate_conflict(batch, block_size)


def check_inputs(batch: PrefillBatch, policy: PrefillPolicy, layout: PageTableLayout) -> tuple[int, ...]:
    """Raises the first broken rule as a ``PrefillInputError`` subclass.

    Returns each row's mapped block count, ``ceil(length / block_size)``.
    """
    _check_arguments(batch, policy, layout)
    check_policy_fits_layout(policy, layout)
    needs, mapped = _check_rows(batch, policy, layout)
    _check_block_conflicts(batch, layout.block_size, needs, mapped)
    return tuple(needs)
