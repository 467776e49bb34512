"""Packed steps of a hybrid call: ``packed.py``'s segments, read and written through one table per KV group.

Theory of operation
-------------------
1. **Judged and masked as padded**: every group's table is judged inside
   its kept columns and held masked (``group_tables.judged_groups``), so an
   entry outside a window reaches nothing here either.
2. **Geometry is ``packed.py``'s**: real tokens end to end, a row's first
   segment at its cached offset (any position), logits rows before sampled
   ones. Since no segment starts before its cached offset, no position is
   recomputed and no K/V is taken from the pool (no ``reused`` span).
3. **Rows read only blocks no other row of the call writes.** A call where
   a row reads as cached (in any group) a block another row writes is not
   packed: ``prepare_grouped_packed`` returns None and the caller plans
   padded waves, which order such requests (geometry never changes results).
4. **Per step and group** (``GroupedPackedRequest.step_tables``), in the
   group's block units: each token's write slot ``block * bs + p % bs``
   through its row's blocks (-1 for a fully cached row's re-run), and each
   segment's prefix: the columns ``[first, ceil(start / bs))`` its queries'
   windows reach (``windows.read_columns`` clipped at the row's floor) and
   the row's blocks there. A kernel gathers nothing else.

Eager only, as every packed step (``packed.py``'s identity rule).
"""

from __future__ import annotations

import attrs

from prefill_core.inputs.batch import PrefillBatch
from prefill_core.kv_groups.attention_layout import AttentionLayout
from prefill_core.kv_groups.group_tables import judged_groups
from prefill_core.kv_groups.windows import read_columns
from prefill_core.planning.packed import PackedRequest, PackedStep, _pack, _request, packed_signature
from prefill_core.planning.prepared import PreparedPrefill, _sampling_path
from prefill_core.values.intmath import ceil_div
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy

__all__ = ["GroupPackedTables", "GroupedPackedRequest", "prepare_grouped_packed"]

Rows = tuple[tuple[int, ...], ...]


@attrs.frozen
class GroupPackedTables:
    """One packed step's view of one KV group.

    ``write_slots`` per token (-1: writes nothing); per segment,
    ``prefix_from`` (the first column read) and ``prefix`` (the row's blocks
    at columns ``prefix_from ..`` up to the segment's start; empty: none).
    """

    write_slots: tuple[int, ...]
    prefix_from: tuple[int, ...]
    prefix: tuple[tuple[int, ...], ...]


@attrs.frozen
class GroupedPackedRequest:
    """A packed request of a hybrid call: the request, each group's masked rows and floors (by caller row)."""

    prepared: PreparedPrefill
    attention: AttentionLayout
    group_rows: tuple[Rows, ...] = attrs.field(repr=False)
    floors: tuple[tuple[int, ...], ...] = attrs.field(repr=False)

    @property
    def request(self) -> PackedRequest:
        return self.prepared.request

    def step_tables(self, index: int) -> tuple[GroupPackedTables, ...]:
        """Every group's tables for step ``index`` (rule 4)."""
        step = self.request.steps[index]
        return tuple(
            _group_tables(step, rows, floors, group.window, group.block_size)
            for group, rows, floors in zip(self.attention.groups, self.group_rows, self.floors)
        )

    def written_blocks(self, index: int) -> dict[int, tuple[int, ...]]:
        """Per caller row with a segment in step ``index``, the blocks it writes in every group."""
        written: dict[int, tuple[int, ...]] = {}
        for group, rows in zip(self.attention.groups, self.group_rows):
            bs = group.block_size
            for s in self.request.steps[index].segments:
                blocks = rows[s.row][s.start // bs : ceil_div(s.end, bs)] if s.writes else ()
                written[s.row] = written.get(s.row, ()) + blocks
        return written


def _group_tables(step: PackedStep, rows: Rows, floors: tuple[int, ...], window, bs: int) -> GroupPackedTables:
    slots: list[int] = []
    firsts, prefixes = [], []
    for s in step.segments:
        blocks = rows[s.row]
        if s.writes:
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(s.start, s.end))
        else:
            slots.extend([-1] * s.length)
        columns = read_columns(s.start, s.start, floors[s.row], window, bs)
        firsts.append(columns.start)
        prefixes.append(tuple(blocks[c] for c in columns))
    return GroupPackedTables(tuple(slots), tuple(firsts), tuple(prefixes))


def _reads_another_rows_writes(masked, spans) -> bool:
    """Whether some row reads as cached, in some group, a block another row of the call writes (rule 3)."""
    for rows, group_spans in zip(masked, spans):
        writer = {rows[r][c]: r for r, span in enumerate(group_spans) for c in span.written}
        for r, span in enumerate(group_spans):
            cached_stop = span.written.start if span.written else span.kept.stop
            if any(writer.get(rows[r][c], r) != r for c in range(span.kept.start, cached_stop)):
                return True
    return False


def prepare_grouped_packed(
    batch: PrefillBatch,
    policy: PrefillPolicy,
    layout: PageTableLayout,
    attention: AttentionLayout,
    group_blocks,
    **limits,
) -> tuple[GroupedPackedRequest, ...] | None:
    """Plans a hybrid call as packed steps; None where rule 3 forbids it. Arguments, ``limits`` (``null_block``,
    ``max_position``, ``shared_blocks``) and errors (a ``PrefillInputError`` subclass) are ``prepare_grouped``'s."""
    if len(batch) > policy.lane_size:  # packed steps have no waves to split: the whole call is one lane
        policy = attrs.evolve(policy, lane_size=len(batch))
    _, spans, masked = judged_groups(batch, policy, layout, attention, group_blocks, **limits)
    if _reads_another_rows_writes(masked, spans):
        return None
    floors = tuple(tuple(span.kept.start for span in group_spans) for group_spans in spans)
    planning = attrs.evolve(batch, blocks=masked[0])
    budget = policy.max_chunk_length
    logits_rows = [r for r in range(len(batch)) if batch.sampling[r] is None]
    sampled_rows = [r for r in range(len(batch)) if batch.sampling[r] is not None]
    planned = []
    for rows in (logits_rows, sampled_rows):  # packed.py rule 2: one kind of output per step
        if not rows:
            continue
        pending: list[PackedStep] = []
        for segments, ending in _pack(planning, rows, budget, {}):
            pending.append(PackedStep(tuple(segments)))
            if ending:
                request = _request(planning, pending, ending, budget, layout.block_size)
                path = _sampling_path(request, policy)
                prepared = PreparedPrefill(request, path, packed_signature(request, path), None)
                planned.append(GroupedPackedRequest(prepared, attention, masked, floors))
                pending = []
    return tuple(planned)
