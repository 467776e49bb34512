"""``plan_call``: the one choice of a call's plan, and ``replays_call``, the traced question it answers.

Properties over valid random cases (``tests/strategies.py``): the plan is the
planner its kind names (nothing else chooses), every caller row is served
exactly once, a call of unslotted rows wider than the lane is served in
sub-batches of at most ``lane_size`` rows, and a traced call's coverage is
exactly ``replays_call``'s answer for any set of captured bodies.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_core import (
    CallContext,
    ExecutionMode,
    LaneTraces,
    PageTableLayout,
    PlanKind,
    PrefillBatch,
    PrefillPolicy,
    plan_call,
    prepare_packed,
    prepare_prefill,
)
from prefill_core.calls.call_plan import workspace_key
from prefill_core.calls.trace_check import replays_call
from prefill_core.values.errors import PrefillInputError, TraceCoverageError
from tests.strategies import cases

MODES = st.sampled_from(list(ExecutionMode))


def _rows(plan) -> list[int]:
    return sorted(r for p in plan.prepared for r in p.request.source_rows)


@settings(max_examples=60, deadline=None)
@given(case=cases(), mode=MODES, packed=st.booleans())
def test_the_plan_is_the_planner_its_kind_names(case, mode, packed):
    """Packed exactly where the lane packs and the mode will not replay; padded waves equal prepare_prefill's."""
    context = CallContext(case.policy, case.layout, mode, packed)
    plan = plan_call(case.batch, context)
    assert plan.kind is (PlanKind.PACKED if packed and mode is not ExecutionMode.TRACED else PlanKind.PADDED)
    expected = prepare_packed if plan.kind is PlanKind.PACKED else prepare_prefill
    assert plan.prepared == expected(case.batch, case.policy, case.layout)
    assert _rows(plan) == list(range(len(case.batch)))
    assert plan.replays == (mode is ExecutionMode.TRACED)  # nothing captured: only traced "replays" (and refuses)
    assert len(plan.gaps) == len(plan.prepared)


@settings(max_examples=60, deadline=None)
@given(case=cases(min_rows=2), packed=st.booleans())
def test_unslotted_rows_wider_than_the_lane_run_in_lane_sized_sub_batches(case, packed):
    """A caller that chose no slots is served whatever its row count: each padded wave within lane_size rows."""
    narrow = attrs.evolve(case.policy, lane_size=max(1, len(case.batch) // 2))
    batch = attrs.evolve(case.batch, slots=tuple(range(len(case.batch))))
    context = CallContext(narrow, case.layout, ExecutionMode.EAGER, packed, slots_chosen=False)
    plan = plan_call(batch, context)
    assert _rows(plan) == list(range(len(batch)))
    if plan.kind is PlanKind.PADDED:
        assert all(p.request.active_batch_size <= narrow.lane_size for p in plan.prepared)
    with pytest.raises(PrefillInputError):  # the same rows, slots chosen: a slot past the lane is refused
        plan_call(batch, attrs.evolve(context, slots_chosen=True))


@settings(max_examples=60, deadline=None)
@given(case=cases(), data=st.data())
def test_a_traced_call_is_covered_exactly_when_replays_call_says_so(case, data):
    """For any subset of the call's bodies captured (with workspaces), replays_call(lengths, cached) is True
    iff the traced plan has no gaps, and require_replay refuses exactly the uncovered plan."""
    eager = plan_call(case.batch, CallContext(case.policy, case.layout, ExecutionMode.TRACED))
    bodies = sorted({p.trace_signature for p in eager.prepared if p.trace_signature}, key=lambda s: s.key)
    kept = data.draw(st.lists(st.sampled_from(bodies), unique=True)) if bodies else []
    traces = LaneTraces(kept, {workspace_key(p.program_signature) for p in eager.prepared})
    context = CallContext(case.policy, case.layout, ExecutionMode.TRACED, traces=traces)
    plan = plan_call(case.batch, context)
    batch = case.batch
    answer = replays_call(list(batch.lengths), list(batch.cached), context, batch.slots, batch.sampling)
    assert answer == (not plan.gaps)
    if plan.gaps:
        with pytest.raises(TraceCoverageError):
            plan.require_replay()
    else:
        plan.require_replay()


def test_replays_call_is_false_for_rows_a_call_would_refuse():
    """Bad rows (no rows, a cached count past its length, a non-int) answer False, never raise."""
    context = CallContext(PrefillPolicy(), PageTableLayout(32, 8, 64), ExecutionMode.TRACED)
    assert not replays_call([], [], context)
    assert not replays_call([10], [11], context)
    assert not replays_call([10], [True], context)
    assert not replays_call([10_000], [0], context)  # past the layout's capacity


def test_group_tables_without_kv_groups_are_refused_by_name():
    """Tables per group on a model without groups name group_page_tables, before anything is planned."""
    batch = PrefillBatch((8,), (0,), (0,), ((1,),), (None,))
    context = CallContext(PrefillPolicy(), PageTableLayout(32, 8, 64), group_tables=(((1,),),))
    with pytest.raises(PrefillInputError, match="group_page_tables"):
        plan_call(batch, context)


def test_one_table_serves_every_group_only_where_the_groups_do_not_share_block_ids():
    """Two rows, two KV groups (sliding, full), every group given the same table: planned where each group's
    block ids are its own (a buffer per layer), refused by name where they are one space (vLLM's buffers)."""
    from prefill_core import AttentionLayout
    from prefill_core.values.errors import BlockConflictError

    attention = AttentionLayout.from_layer_types(
        ("sliding_attention", "full_attention"), sliding_window=16, block_size=16
    )
    batch = PrefillBatch((40, 30), (0, 0), (0, 1), ((1, 2, 3), (4, 5)), (None, None))
    rows = ((1, 2, 3), (4, 5))
    context = CallContext(PrefillPolicy(), PageTableLayout(16, 8, 64), attention=attention, group_tables=(rows, rows))
    plan = plan_call(batch, attrs.evolve(context, groups_share_blocks=False))
    assert plan.kind is PlanKind.GROUPED and _rows(plan) == [0, 1]
    with pytest.raises(BlockConflictError, match="one block"):
        plan_call(batch, context)
