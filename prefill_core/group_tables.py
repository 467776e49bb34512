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
   columns the step reads (``windows.prefix_columns`` and its own) and the
   filler 0 everywhere else.
5. **Identity**: each signature gains one ``GroupWidths`` per group (kind,
   window, block size, fill and read widths). Widths follow the chunk
   length and the layout only, so one trace serves every cached offset.

Padded waves only: a hybrid call is not planned as packed steps yet.
"""

from __future__ import annotations

import attrs

from .attention_layout import AttentionLayout, KVGroup
from .batch import PrefillBatch
from .block_order import order_by_dependencies
from .errors import InvalidPageTableError
from .geometry import chunked_fill_width, chunked_read_width, regular_table_width
from .group_rules import GroupRowSpan, check_group_tables
from .intmath import ceil_div
from .layout import PageTableLayout
from .plan import CHUNKED_FILLER, plan_geometry
from .policy import PrefillPolicy
from .prepared import PreparedPrefill, prepare_request
from .request import PrefillRequest
from .signatures import GroupWidths
from .tables import SKIP
from .validate import checked_scope
from .windows import window_floor

__all__ = ["OUTSIDE", "GroupStepTables", "GroupedRequest", "prepare_grouped"]

OUTSIDE = -1
"""What a planned group row holds at a column none of its steps reads or writes."""

Rows = tuple[tuple[int, ...], ...]


@attrs.frozen
class GroupStepTables:
    """One step's tables for one KV group: ``fill`` ``[padded_batch, fill_width]``, ``read`` for chunked steps."""

    fill: Rows
    read: Rows | None


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

    def written_blocks(self, index: int) -> tuple[dict[int, tuple[int, ...]], ...]:
        """Per group, per active caller row: the blocks step ``index`` writes, in column order."""
        return tuple(
            {row: tuple(b for b in fill if b >= 0) for row, fill in zip(self.request.source_rows, tables.fill)}
            for tables in self.step_tables(index)
        )


def _step_tables(
    group: KVGroup, rows: Rows, request: PrefillRequest, start: int, end: int, widths: GroupWidths
) -> GroupStepTables:
    bs = group.block_size
    first = start // bs
    fills, reads = [], []
    for blocks, length, cached in zip(rows, request.lengths, request.cached):
        stop = ceil_div(min(end, length), bs)
        lo_write = cached // bs if cached < length else stop  # a fully cached row writes nothing
        fill = [SKIP] * widths.fill_width
        for column in range(max(first, lo_write), stop):
            fill[column - first] = blocks[column]
        fills.append(tuple(fill))
        if widths.read_width:
            read = [CHUNKED_FILLER] * widths.read_width
            for column in range(window_floor(start, group.window) // bs, stop):
                read[column] = blocks[column]
            reads.append(tuple(read))
    padding = request.padded_batch - len(rows)
    fills.extend([(SKIP,) * widths.fill_width] * padding)
    return GroupStepTables(tuple(fills), tuple(reads) if widths.read_width else None)


def _masked(blocks: tuple[int, ...], span: GroupRowSpan, need: int) -> tuple[int, ...]:
    if span.kept.start == 0:
        return blocks[:need]
    return (OUTSIDE,) * span.kept.start + blocks[span.kept.start : need]


def _widths(group: KVGroup, request: PrefillRequest, policy: PrefillPolicy, layout: PageTableLayout) -> GroupWidths:
    bs = group.block_size
    if request.read_table is None:
        fill, read = regular_table_width(policy, bs, request.padded_length), 0
    else:
        chunk = request.chunk_length
        fill, read = chunked_fill_width(policy, bs, chunk), chunked_read_width(policy, layout, chunk, bs)
    return GroupWidths(group.kind.value, group.window, bs, fill, read)


def _dependencies(requests, attention: AttentionLayout, masked, spans) -> list[set[int]]:
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


def prepare_grouped(
    batch: PrefillBatch,
    policy: PrefillPolicy,
    layout: PageTableLayout,
    attention: AttentionLayout,
    group_blocks: tuple[Rows, ...],
    *,
    null_block: int | None = None,
    max_position: int | None = None,
) -> tuple[GroupedRequest, ...]:
    """Plans a call with one table per KV group (``group_blocks[g][row]``); raises ``PrefillInputError``.

    ``batch.blocks`` must be group 0's table (the plugin's ``page_table``);
    ``null_block`` is the caller's never-written block (vLLM's 0), which no
    column a step reads or writes may name.
    """
    scope = checked_scope(batch, policy, layout, max_position=max_position, block_rules=False)
    attention.check_fits(layout.block_size)
    if type(group_blocks) is tuple and group_blocks and group_blocks[0] != batch.blocks:
        msg = "PrefillBatch.blocks is invalid: it must be group 0's table (group_blocks[0]), the plugin's page_table"
        raise InvalidPageTableError(msg, field="blocks")
    spans = check_group_tables(
        attention,
        group_blocks,
        batch.lengths,
        batch.cached,
        planning_block_size=layout.block_size,
        num_blocks=layout.num_blocks,
        null_block=null_block,
    )
    masked = tuple(
        tuple(_masked(b, s, ceil_div(n, g.block_size)) for b, s, n in zip(rows, group_spans, batch.lengths))
        for g, rows, group_spans in zip(attention.groups, group_blocks, spans)
    )
    planning = attrs.evolve(batch, blocks=masked[0])
    requests = plan_geometry(planning, scope.needs, policy, layout)
    requests = order_by_dependencies(requests, _dependencies(requests, attention, masked, spans))
    planned = []
    for request in requests:
        prepared = prepare_request(request, policy)
        groups = tuple(_widths(g, request, policy, layout) for g in attention.groups)
        trace = None if prepared.trace_signature is None else attrs.evolve(prepared.trace_signature, groups=groups)
        program = attrs.evolve(prepared.program_signature, groups=groups)
        prepared = attrs.evolve(prepared, program_signature=program, trace_signature=trace)
        rows = tuple(tuple(m[r] for r in request.source_rows) for m in masked)
        planned.append(GroupedRequest(prepared, attention, rows))
    return tuple(planned)
