"""Packed steps of a hybrid call (``kv_groups.group_packed``): what each segment reads and writes per KV group.

The calls are ``test_windows.hybrid_cases``: fresh blocks in every kept column, the null block and ids of
blocks another request holds everywhere else.
"""

from __future__ import annotations

from hypothesis import given, note, settings
from hypothesis import strategies as st

from prefill_core import AttentionLayout, PageTableLayout, PrefillBatch, PrefillPolicy, prepare_grouped_packed
from prefill_core.kv_groups.windows import read_columns
from tests.core.kv_groups.test_windows import FOREIGN, NULL, hybrid_cases

FEWER = settings(max_examples=max(1, settings().max_examples // 4))
"""A quarter of the profile's examples: ``test_windows`` runs the same cases through the padded planner."""


def _packed(case, tables=None):
    tables = case.tables if tables is None else tables
    planned = prepare_grouped_packed(
        case.batch(tables), case.policy, case.layout, case.attention, tables, null_block=NULL
    )
    assert planned is not None  # fresh blocks per row: no row reads another's writes
    return planned


@FEWER
@given(hybrid_cases())
def test_a_packed_segment_reads_only_its_windows_columns_of_its_own_row(case):
    """Each segment's prefix is the row's blocks at ``read_columns(start)`` (inside its kept columns), nothing else."""
    note(repr(case))
    for grouped in _packed(case):
        for index, step in enumerate(grouped.request.steps):
            for g, (group, tables) in enumerate(zip(case.attention.groups, grouped.step_tables(index))):
                for i, s in enumerate(step.segments):
                    floor = case.kept[g][s.row].start
                    columns = read_columns(s.start, s.start, floor, group.window, group.block_size)
                    assert tables.prefix_from[i] == columns.start
                    assert tables.prefix[i] == tuple(case.tables[g][s.row][c] for c in columns)
                    assert all(c in case.kept[g][s.row] for c in columns)


@FEWER
@given(hybrid_cases())
def test_a_packed_step_writes_exactly_the_owed_positions_through_each_groups_blocks(case):
    """Every token's slot in every group is its row's block there; over the call each row writes ``[cached, n)``."""
    written: dict[tuple[int, int], list[int]] = {}
    for grouped in _packed(case):
        for index, step in enumerate(grouped.request.steps):
            for g, (group, tables) in enumerate(zip(case.attention.groups, grouped.step_tables(index))):
                bs = group.block_size
                slots = iter(tables.write_slots)
                for s in step.segments:
                    for p in range(s.start, s.end):
                        slot = next(slots)
                        if not s.writes:
                            assert slot == -1
                            continue
                        assert slot == case.tables[g][s.row][p // bs] * bs + p % bs
                        written.setdefault((g, s.row), []).append(p)
    for g in range(len(case.attention.groups)):
        for row, (n, c) in enumerate(zip(case.lengths, case.cached)):
            assert written.get((g, row), []) == (list(range(c, n)) if c < n else [])


@FEWER
@given(hybrid_cases(), st.randoms(use_true_random=False))
def test_packed_plans_of_tables_differing_only_outside_the_windows_are_equal(case, rnd):
    """Whatever lies outside the kept columns, the packed plan and every step's tables are equal."""
    changed = tuple(
        tuple(
            tuple(b if j in kept else rnd.choice([NULL, FOREIGN + 3, FOREIGN + 9]) for j, b in enumerate(row))
            for row, kept in zip(rows, spans)
        )
        for rows, spans in zip(case.tables, case.kept)
    )
    planned, again = _packed(case), _packed(case, changed)
    assert planned == again
    for a, b in zip(planned, again):
        assert all(a.step_tables(i) == b.step_tables(i) for i in range(a.request.num_chunks))


def test_a_row_reading_a_block_another_row_of_the_call_writes_is_not_packed():
    """A same-call prefix hit (row 1's cached block is row 0's first, written in this call) plans no packed steps."""
    attention = AttentionLayout.from_layer_types(
        ("sliding_attention", "full_attention"), sliding_window=40, block_size=16, sliding_block_size=16
    )
    layout = PageTableLayout(16, 8, 64)
    policy = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2), lane_size=2)
    tables = (((1, 2, 3), (1, 4, 5)), ((6, 7, 8), (6, 9, 10)))
    batch = PrefillBatch((40, 40), (0, 16), (0, 1), tables[0], (None, None))
    assert prepare_grouped_packed(batch, policy, layout, attention, tables, null_block=NULL) is None
    apart = (((1, 2, 3), (11, 4, 5)), ((6, 7, 8), (12, 9, 10)))
    assert prepare_grouped_packed(batch, policy, layout, attention, apart, null_block=NULL) is not None
