"""A call with one page table per KV group: planned once, then each step's tables per group.

Theory of operation
-------------------
A hybrid model's call carries one page table per KV group
(``attention_layout``); vLLM's Tenstorrent plugin sends them as
``page_tables_per_layer``. ``prepare_grouped`` plans it:

1. **Geometry is the planner's** (``plan.plan_geometry``): waves, chunk
   lengths and starts depend on lengths, offsets and the policy, never on a
   table, so every group steps through the same chunks.
2. **Tables enter the plan masked.** Each group's table is judged inside
   its kept columns (``group_rules``) and held with every other entry
   replaced by ``OUTSIDE`` (-1): two calls whose tables differ only outside
   the windows plan to equal values, so nothing outside a window (the null
   block, a stale id of a block another request now holds) can reach a
   staged table, a read or a write.
3. **Order**: a request runs after every request that writes a block it
   reads as cached in any group (``block_order.order_by_dependencies``).
4. **Per step and group** (``GroupedRequest.step_tables``), in the group's
   own block units: the fill table holds the blocks the step writes
   (columns ``written_columns`` inside the step, -1 elsewhere), and a
   chunked step's read table, indexed by absolute column as a paged
   attention kernel indexes it, holds the row's blocks at exactly the
   columns the step reads (``windows.read_columns``: its window clipped at
   the row's floor) and the filler 0 everywhere else; with them the first
   readable column and the positions whose K/V come from the pool
   (``windows.reused_span``).
5. **Identity**: each signature gains one ``GroupWidths`` per group (kind,
   window, block size, fill and read widths). Widths follow the chunk
   length and the layout only, so one trace serves every cached offset.

Packed steps of a hybrid call are ``group_packed.py``.
"""

from __future__ import annotations

import attrs

from prefill_core.inputs.batch import PrefillBatch
from prefill_core.inputs.validate import checked_scope
from prefill_core.kv_groups.attention_layout import AttentionLayout, KVGroup
from prefill_core.kv_groups.group_rules import GroupRowSpan, check_group_tables
from prefill_core.kv_groups.windows import kept_columns, read_columns, reused_span
from prefill_core.planning.block_order import order_by_dependencies
from prefill_core.planning.geometry import chunked_fill_width, chunked_read_width, regular_table_width
from prefill_core.planning.plan import CHUNKED_FILLER, plan_geometry
from prefill_core.planning.prepared import PreparedPrefill, prepare_request
from prefill_core.planning.request import PrefillRequest
from prefill_core.planning.signatures import GroupWidths, PrefillTraceSignature
from prefill_core.values.intmath import ceil_div
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy
from prefill_core.values.tables import SKIP

__all__ = ["OUTSIDE", "GroupStepTables", "GroupedRequest", "body_groups", "prepare_grouped"]

OUTSIDE = -1
"""What a planned group row holds at a column none of its steps reads or writes."""

Rows = tuple[tuple[int, ...], ...]


@attrs.frozen
class GroupStepTables:
    """One step's tables for one KV group, per physical row.

    ``fill`` ``[padded_batch, fill_width]``: the blocks the step writes.
    ``read`` (chunked steps) ``[padded_batch, read_width]``: absolute
    columns; the row's blocks at the columns the step reads, the filler 0
    elsewhere. ``read_from``: the first column the step may read (the row's
    floor, ``windows.kept_columns``): a kernel gathers nothing before it.
    ``reused``: the positions ``[lo, hi)`` whose K/V the step takes from the
    pool instead of recomputing (``windows.reused_span``; empty but on a
    first step that starts inside a cached block).
    """

    fill: Rows
    read: Rows | None
    read_from: tuple[int, ...]
    reused: tuple[tuple[int, int], ...]


@attrs.frozen
class GroupedRequest:
    """A planned request of a hybrid call: the request, and each group's masked rows (by active row)."""

    prepared: PreparedPrefill
    attention: AttentionLayout
    group_rows: tuple[Rows, ...] = attrs.field(repr=False)

    @property
    def request(self) -> PrefillRequest:
        return self.prepared.request

    def step_tables(self, index: int) -> tuple[GroupStepTables, ...]:
        """Every group's tables for step ``index`` (rule 4)."""
        request = self.request
        chunk = request.chunk(index)
        widths = self.prepared.program_signature.groups
        return tuple(
            _step_tables(group, rows, request, chunk.start, chunk.end, w)
            for group, rows, w in zip(self.attention.groups, self.group_rows, widths)
        )

    def written_blocks(self, index: int) -> dict[int, tuple[int, ...]]:
        """Per active caller row, the blocks step ``index`` writes in every group (one block-id space), by group."""
        written: dict[int, tuple[int, ...]] = dict.fromkeys(self.request.source_rows, ())
        for tables in self.step_tables(index):
            for row, fill in zip(self.request.source_rows, tables.fill):
                written[row] += tuple(b for b in fill if b >= 0)
        return written


def _step_tables(
    group: KVGroup, rows: Rows, request: PrefillRequest, start: int, end: int, widths: GroupWidths
) -> GroupStepTables:
    bs, window = group.block_size, group.window
    first = start // bs
    fills, reads, floors, reused = [], [], [], []
    for blocks, length, cached in zip(rows, request.lengths, request.cached):
        floor = kept_columns(length, cached, window, bs).start
        stop = min(end, length)
        lo_write = cached // bs if cached < length else ceil_div(stop, bs)  # a fully cached row writes nothing
        fill = [SKIP] * widths.fill_width
        for column in range(max(first, lo_write), ceil_div(stop, bs)):
            fill[column - first] = blocks[column]
        fills.append(tuple(fill))
        if widths.read_width:
            read = [CHUNKED_FILLER] * widths.read_width
            for column in read_columns(start, stop, floor, window, bs):
                read[column] = blocks[column]
            reads.append(tuple(read))
        floors.append(floor)
        span = reused_span(start, end, cached, floor, bs)
        reused.append((span.start, span.stop) if span else (0, 0))
    padding = request.padded_batch - len(rows)
    fills.extend([(SKIP,) * widths.fill_width] * padding)
    if widths.read_width:
        reads.extend([(CHUNKED_FILLER,) * widths.read_width] * padding)
    return GroupStepTables(
        tuple(fills),
        tuple(reads) if widths.read_width else None,
        tuple(floors) + (0,) * padding,
        tuple(reused) + ((0, 0),) * padding,
    )


def _masked(blocks: tuple[int, ...], span: GroupRowSpan, need: int) -> tuple[int, ...]:
    if span.kept.start == 0:
        return blocks[:need]
    return (OUTSIDE,) * span.kept.start + blocks[span.kept.start : need]


def body_groups(
    body: PrefillTraceSignature, attention: AttentionLayout, policy: PrefillPolicy, layout: PageTableLayout
) -> tuple[GroupWidths, ...]:
    """Each group's ``GroupWidths`` for a body of this geometry (rule 5): chunk length and layout only."""
    chunk, chunked = body.chunk_length, body.read_table_width > 0
    widths = []
    for group in attention.groups:
        bs = group.block_size
        if chunked:
            fill, read = chunked_fill_width(policy, bs, chunk), chunked_read_width(policy, layout, chunk, bs)
        else:
            fill, read = regular_table_width(policy, bs, chunk), 0  # a regular step's chunk is its padded length
        widths.append(GroupWidths(group.kind.value, group.window, bs, fill, read))
    return tuple(widths)


def group_dependencies(requests, attention: AttentionLayout, masked, spans) -> list[set[int]]:
    """Per request, the requests writing a block it reads as cached, in any group (rule 3)."""
    writer: dict[tuple[int, int], int] = {}
    reads: list[set[tuple[int, int]]] = []
    for index, request in enumerate(requests):
        read: set[tuple[int, int]] = set()
        for g in range(len(attention.groups)):
            for row in request.source_rows:
                blocks, span = masked[g][row], spans[g][row]
                for column in span.written:
                    writer[g, blocks[column]] = index
                cached_stop = span.written.start if span.written else span.kept.stop
                read.update((g, blocks[c]) for c in range(span.kept.start, cached_stop))
        reads.append(read)
    return [{writer[key] for key in read if key in writer} - {i} for i, read in enumerate(reads)]


def judged_groups(
    batch, policy, layout, attention, group_blocks, *, null_block=None, max_position=None, shared_blocks=True
):
    """``(scope, spans, masked)``: the call judged (inputs, fit, every group's table, rule 2) and its rows masked.

    ``spans[g][row]`` are the row's kept and written columns in group g;
    ``masked[g][row]`` its blocks with ``OUTSIDE`` at every column it never touches.
    """
    scope = checked_scope(batch, policy, layout, max_position=max_position, block_rules=False)
    attention.check_fits(layout.block_size)
    spans = check_group_tables(
        attention,
        group_blocks,
        batch.lengths,
        batch.cached,
        num_blocks=layout.num_blocks,
        null_block=null_block,
        shared_blocks=shared_blocks,
    )
    masked = tuple(
        tuple(_masked(b, s, ceil_div(n, g.block_size)) for b, s, n in zip(rows, group_spans, batch.lengths))
        for g, rows, group_spans in zip(attention.groups, group_blocks, spans)
    )
    return scope, spans, masked


def prepare_grouped(
    batch: PrefillBatch,
    policy: PrefillPolicy,
    layout: PageTableLayout,
    attention: AttentionLayout,
    group_blocks: tuple[Rows, ...],
    *,
    null_block: int | None = None,
    max_position: int | None = None,
    shared_blocks: bool = True,
) -> tuple[GroupedRequest, ...]:
    """Plans a call with one table per KV group (``group_blocks[g][row]``); raises ``PrefillInputError``.

    ``batch.blocks`` is not read: every group's table, group 0's (the
    plugin's ``page_table``) included, is ``group_blocks``, in the group's
    own block size. ``null_block`` is the caller's never-written block (vLLM's 0), which no
    column a step reads or writes may name. ``shared_blocks``: one block-id
    space for every group (``group_rules.check_group_tables``).
    """
    limits = {"null_block": null_block, "max_position": max_position, "shared_blocks": shared_blocks}
    scope, spans, masked = judged_groups(batch, policy, layout, attention, group_blocks, **limits)
    planning = attrs.evolve(batch, blocks=masked[0])
    requests = plan_geometry(planning, scope.needs, policy, layout)
    requests = order_by_dependencies(requests, group_dependencies(requests, attention, masked, spans))
    planned = []
    for request in requests:
        prepared = prepare_request(request, policy)
        groups = body_groups(prepared.program_signature.body, attention, policy, layout)
        trace = None if prepared.trace_signature is None else attrs.evolve(prepared.trace_signature, groups=groups)
        program = attrs.evolve(prepared.program_signature, groups=groups)
        prepared = attrs.evolve(prepared, program_signature=program, trace_signature=trace)
        rows = tuple(tuple(m[r] for r in request.source_rows) for m in masked)
        planned.append(GroupedRequest(prepared, attention, rows))
    return tuple(planned)
