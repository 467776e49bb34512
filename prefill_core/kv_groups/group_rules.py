"""The page-table rules of a call with one table per KV group, judged inside each group's window.

The single-table rules (``rules.RULES``, "block ids in the pool" to "shared
cached block at one column") read every mapped column. A sliding group's
table holds, before the window, the null block many times over or stale ids
of blocks vLLM freed and gave to another request: judging those would refuse
every real call, and reading them would corrupt it. So each group's table is
judged over its *kept columns* (``windows.kept_columns``: the columns its
steps read or write) only, with the same rules, plus two of its own:

* a kept column maps a real block: in the pool and not the caller's null
  block (``WindowTableError``);
* one block-id space: a block kept (read or written) in one group is kept
  by no row of another group. vLLM draws every group's blocks from one pool
  and gives a block to one group at a time, and its groups share KV tensors
  (tensor i holds layer i of every group, ``kv_grouping.py``): a block named
  in two groups is one layer's KV read or overwritten as another's.

Errors name the row, ``group_blocks[g][j]``, the value and the rule, and are
raised before anything is planned. Nothing outside the kept columns is read.
"""

from __future__ import annotations

import attrs

from prefill_core.kv_groups.attention_layout import AttentionLayout, KVGroup
from prefill_core.kv_groups.windows import kept_columns
from prefill_core.values.computed_positions import written_columns
from prefill_core.values.errors import (
    BlockConflictError,
    InvalidPageTableError,
    PrefillInputError,
    RepeatedBlockError,
    SharedBlockColumnError,
    WindowTableError,
)
from prefill_core.values.intmath import ceil_div

__all__ = ["GroupRowSpan", "group_spans", "check_group_tables"]


@attrs.frozen
class GroupRowSpan:
    """One row's columns in one group: ``kept`` (read or written), of which ``written`` are written."""

    kept: range
    written: range


def group_spans(group: KVGroup, lengths: tuple[int, ...], cached: tuple[int, ...]) -> tuple[GroupRowSpan, ...]:
    """Each row's kept and written columns in ``group`` (``windows.kept_columns``, ``written_columns``)."""
    bs, window = group.block_size, group.window
    return tuple(
        GroupRowSpan(kept_columns(length, offset, window, bs), written_columns(length, offset, bs))
        for length, offset in zip(lengths, cached)
    )


def _error(cls: type[PrefillInputError], row: int, group: int, column: int, value: object, rule: str):
    field = f"group_blocks[{group}][{column}]"
    msg = f"row {row}: {field}={value!r} is invalid: {rule}"
    return cls(msg, row=row, field=field)


def _check_shape(g: int, rows: object, lengths: tuple[int, ...], block_size: int) -> None:
    if type(rows) is not tuple or len(rows) != len(lengths):
        got = type(rows).__name__ if type(rows) is not tuple else f"{len(rows)} rows"
        msg = f"group_blocks[{g}]={got} is invalid: must be a tuple of one page-table row per batch row"
        raise InvalidPageTableError(msg, field=f"group_blocks[{g}]")
    for row, (blocks, length) in enumerate(zip(rows, lengths)):
        need = ceil_div(length, block_size)
        if type(blocks) is not tuple or len(blocks) < need:
            shown = type(blocks).__name__ if type(blocks) is not tuple else f"<{len(blocks)} entries>"
            msg = (
                f"row {row}: group_blocks[{g}]={shown} is invalid: the group's table needs "
                f"ceil(length={length} / block_size={block_size}) = {need} entries"
            )
            raise InvalidPageTableError(msg, row=row, field=f"group_blocks[{g}]")


def _check_kept(g: int, rows, spans, num_blocks: int, null_block: int | None, window: int | None) -> None:
    for row, (blocks, span) in enumerate(zip(rows, spans)):
        seen: dict[int, int] = {}
        for column in span.kept:
            block = blocks[column]
            if type(block) is not int or not 0 <= block < num_blocks or block == null_block:
                rule = f"the group reads or writes column {column} (window={window}): a block id in [0, {num_blocks})"
                if null_block is not None:
                    rule += f", not the null block {null_block}"
                raise _error(WindowTableError, row, g, column, block, rule)
            first = seen.setdefault(block, column)
            if first != column:
                rule = f"a row maps each block once inside its window; it is also at column {first}"
                raise _error(RepeatedBlockError, row, g, column, block, rule)


def _space(g: int, shared: bool) -> int:
    """The block-id space of group g: one for all groups where they share KV buffers, else the group's own."""
    return 0 if shared else g


def _writers(layout: AttentionLayout, tables, all_spans, shared: bool) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(space, block) -> (group, row, column) of its writer; two writers in one space are an error."""
    writer: dict[tuple[int, int], tuple[int, int, int]] = {}
    for g, (rows, spans) in enumerate(zip(tables, all_spans)):
        for row, (blocks, span) in enumerate(zip(rows, spans)):
            for column in span.written:
                found = writer.setdefault((_space(g, shared), blocks[column]), (g, row, column))
                if found != (g, row, column):
                    rule = f"one block takes one writer; row {found[1]} writes it in group {found[0]}"
                    raise _error(BlockConflictError, row, g, column, blocks[column], rule)
    return writer


def _check_reads(layout, tables, all_spans, writer, lengths, one_space: bool) -> None:
    for g, (group, rows, spans) in enumerate(zip(layout.groups, tables, all_spans)):
        shared: dict[int, tuple[int, int]] = {}
        bs = group.block_size
        for row, (blocks, span) in enumerate(zip(rows, spans)):
            for column in range(span.kept.start, span.written.start if span.written else span.kept.stop):
                block = blocks[column]
                other_row, other_column = shared.setdefault(block, (row, column))
                if other_column != column:
                    rule = (
                        f"rows sharing a cached block map it at one column; row {other_row} maps it at {other_column}"
                    )
                    raise _error(SharedBlockColumnError, row, g, column, block, rule)
                found = writer.get((_space(g, one_space), block))
                if found is None:
                    continue
                wg, wrow, wcol = found
                if wg != g:
                    rule = f"one block-id space: group {wg} of row {wrow} writes it"
                    raise _error(BlockConflictError, row, g, column, block, rule)
                if wcol != column or lengths[wrow] < (column + 1) * bs:
                    rule = f"a block read as cached that row {wrow} writes must be written whole at column {column}"
                    raise _error(BlockConflictError, row, g, column, block, rule)


def check_group_tables(
    layout: AttentionLayout,
    tables: object,
    lengths: tuple[int, ...],
    cached: tuple[int, ...],
    *,
    num_blocks: int,
    null_block: int | None = None,
    shared_blocks: bool = True,
) -> tuple[tuple[GroupRowSpan, ...], ...]:
    """Raises the first broken rule as a named ``PrefillInputError``; returns every group's row spans.

    ``tables[g][r]`` is row r's page-table row of group g; ``null_block`` is
    the caller's never-written block (vLLM's id 0), which no kept column may
    name. Lengths and offsets must already have passed the batch rules.
    ``shared_blocks``: the groups share KV buffers (vLLM's plan), so block ids
    form one space and a block serves one group; False where every layer has
    a buffer of its own, so each group's ids are its own (one table may then
    serve every group).
    """
    if type(tables) is not tuple or len(tables) != len(layout.groups):
        msg = f"group_blocks must be a tuple of one table per KV group ({len(layout.groups)})"
        raise InvalidPageTableError(msg, field="group_blocks")
    all_spans = []
    for g, (group, rows) in enumerate(zip(layout.groups, tables)):
        _check_shape(g, rows, lengths, group.block_size)
        spans = group_spans(group, lengths, cached)
        _check_kept(g, rows, spans, num_blocks, null_block, group.window)
        all_spans.append(spans)
    writer = _writers(layout, tables, all_spans, shared_blocks)
    _check_reads(layout, tables, all_spans, writer, lengths, shared_blocks)
    if shared_blocks:
        _check_one_group_per_block(tables, all_spans)
    return tuple(all_spans)


def _check_one_group_per_block(tables, all_spans) -> None:
    """No block is kept in two groups (the one block-id space rule; writers were judged before)."""
    keeper: dict[int, tuple[int, int, int]] = {}
    for g, (rows, spans) in enumerate(zip(tables, all_spans)):
        for row, (blocks, span) in enumerate(zip(rows, spans)):
            for column in span.kept:
                found = keeper.setdefault(blocks[column], (g, row, column))
                if found[0] != g:
                    rule = (
                        f"one block-id space: row {found[1]} keeps it in group {found[0]} (column {found[2]}); "
                        "groups share KV buffers, so one block serves one group"
                    )
                    raise _error(BlockConflictError, row, g, column, blocks[column], rule)
