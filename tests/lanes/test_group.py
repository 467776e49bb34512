"""``LaneGroup``: rows routed by slot to data-parallel lanes, KV in each lane's own pool, results in caller order."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings

from prefill_core import SamplingParams, WarmupManifest, route_to_lanes
from prefill_core.values.errors import (
    InvalidCachedLengthError,
    InvalidSlotError,
    PrefillConfigError,
    TraceCoverageError,
)
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.lanes.group import LaneGroup
from prefill_shell.reference import random_llama
from prefill_shell.testing.sweep import single_threaded
from tests.lane_kit import (
    BLOCK,
    PER_LANE,
    POOL,
    changed_blocks,
    group_call,
    lane_runtime,
    make_group,
    pool_of,
    same_result,
)
from tests.strategies import lane_group_rows

EXAMPLES = max(4, settings.default.max_examples // 6)
"""Few examples under the ci profile (each builds 2N + 1 runtimes); fifty times more under fuzz."""


@pytest.fixture(scope="module")
def tiny_model():
    return random_llama(0, "tiny")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op torch thread: a tiny model's ops are too small to split, and on shared cores threads contend."""
    with single_threaded():
        yield


def _one_runtime_holding_every_slot(model, group: LaneGroup, call):
    """One runtime with all the group's slots whose pool is the lanes' pools side by side (lane k at k * POOL)."""
    n = group.num_lanes
    single = lane_runtime(model, 99, lane_size=PER_LANE * n, pool=POOL * n)
    kv = single.config.kv
    for pool, parts in zip(kv.keys + kv.values, zip(*(pool_of(lane.runtime) for lane in group.lanes))):
        for k, part in enumerate(parts):
            pool[k * POOL : (k + 1) * POOL] = part[:POOL]
    table = call.table.clone()
    for route in call.routes:
        for row in route.source_rows:
            mapped = table[row] >= 0
            table[row][mapped] += route.lane * POOL
    slots = [route.lane * PER_LANE + s for route in call.routes for s in route.slots]
    rows = [row for route in call.routes for row in route.source_rows]
    slots_by_row = [slots[rows.index(r)] for r in range(len(call.lengths))]
    return single, {**call.kwargs(), "page_table": table, "slots": slots_by_row}


@pytest.mark.parametrize("num_lanes", [1, 2, 4])
def test_a_group_equals_its_lanes_run_alone_and_one_runtime_holding_every_slot(tiny_model, num_lanes):
    """Random calls: bit-equal to N runtimes given only their lane's rows, within 1e-5 of one runtime, KV per lane."""

    @settings(max_examples=EXAMPLES)
    @given(lane_group_rows(num_lanes, PER_LANE))
    def check(drawn):
        rows, slots = drawn
        call = group_call(rows, slots, num_lanes)
        group = make_group(tiny_model, num_lanes)
        alone = [lane_runtime(tiny_model, i) for i in range(num_lanes)]
        single, single_args = _one_runtime_holding_every_slot(tiny_model, group, call)
        before = [pool_of(lane.runtime) for lane in group.lanes]

        got = group.prefill(**call.kwargs())

        assert [r.row for r in got] == list(range(len(rows)))
        for route in call.routes:
            lane = group.lanes[route.lane].runtime
            want = alone[route.lane].prefill(**call.lane_kwargs(route))
            for local, row in enumerate(route.source_rows):
                assert same_result(got[row], want[local]._replace(row=row)), f"row {row} (lane {route.lane})"
            mine = set().union(*(call.written[row] for row in route.source_rows))
            assert changed_blocks(before[route.lane], pool_of(lane)) <= mine
            assert all(torch.equal(a, b) for a, b in zip(pool_of(lane), pool_of(alone[route.lane])))
        untouched = set(range(num_lanes)) - {route.lane for route in call.routes}
        assert all(changed_blocks(before[i], pool_of(group.lanes[i].runtime)) == set() for i in untouched)
        for row, want in enumerate(single.prefill(**single_args)):
            assert same_result(got[row], want, atol=1e-5), f"row {row} vs one runtime holding every slot"

    check()


@pytest.mark.parametrize("threaded", [True, False], ids=["threads", "in turn"])
def test_vllm_data_parallel_empty_slots_reach_their_ranks_lane(tiny_model, threaded):
    """2 lanes x 16 slots; rows of ranks 1 and 0 mixed, ``empty_slots = dp_rank * 16 + i``: each lands in its lane."""
    lanes = [PrefillExecutor(lane_runtime(tiny_model, i, lane_size=16)) for i in range(2)]
    group = LaneGroup(lanes, threaded=threaded)
    assert (group.per_lane_batch, group.max_batch_size) == (16, 32)
    empty_slots = [16 + 3, 5, 16 + 0, 15, 16 + 15, 0]
    rows = [(40, 0, None), (20, 0, SamplingParams.greedy()), (70, 0, None), (33, 16, None), (9, 0, None), (64, 0, None)]
    call = attrs.evolve(group_call(rows, None, 2), slots=tuple(empty_slots))
    routes = {r.lane: r for r in route_to_lanes(empty_slots, 6, 16, 2)}
    assert (routes[0].source_rows, routes[0].slots) == ((1, 3, 5), (5, 15, 0))
    assert (routes[1].source_rows, routes[1].slots) == ((0, 2, 4), (3, 0, 15))
    table = torch.full((6, 8), -1, dtype=torch.int32)
    for route in routes.values():  # each lane's rows take that lane's blocks from 1 up
        first = 1
        for row in route.source_rows:
            need = -(-rows[row][0] // BLOCK)
            table[row, :need] = torch.arange(first, first + need)
            first += need
    call = attrs.evolve(call, table=table)
    before = [pool_of(lane.runtime) for lane in lanes]
    got = group.prefill(**call.kwargs())
    for lane, route in routes.items():
        alone = lane_runtime(tiny_model, lane, lane_size=16).prefill(**call.lane_kwargs(route))
        assert [got[row] for row in route.source_rows] == [
            r._replace(row=row) for r, row in zip(alone, route.source_rows)
        ]
        assert changed_blocks(before[lane], pool_of(lanes[lane].runtime))  # written in its own pool


def test_an_input_error_names_the_caller_row_and_the_lane_and_runs_nothing(tiny_model):
    """A cached length past its prompt at caller row 2 (lane 1's row 0) is refused naming both; no pool changes."""
    group = make_group(tiny_model, 2)
    call = group_call([(40, 0, None), (20, 0, None), (50, 0, None)], (0, 1, PER_LANE), 2)
    before = [pool_of(lane.runtime) for lane in group.lanes]
    with pytest.raises(InvalidCachedLengthError, match=r"row 2: \(lane 1, its row 0\)") as caught:
        group.prefill(**{**call.kwargs(), "cached_lengths": [0, 0, 51]})
    assert caught.value.row == 2
    assert [changed_blocks(b, pool_of(lane.runtime)) for b, lane in zip(before, group.lanes)] == [set(), set()]


def test_a_slot_outside_the_group_is_refused_by_caller_row(tiny_model):
    """Slot 8 on 2 lanes x 4 slots is row 1's ``InvalidSlotError``; 9 rows without slots overflow at row 8."""
    group = make_group(tiny_model, 2)
    call = group_call([(10, 0, None), (10, 0, None)], (0, 1), 2)
    with pytest.raises(InvalidSlotError, match=r"row 1: slot=8"):
        group.prefill(**{**call.kwargs(), "slots": [0, 8]})
    many = group_call([(10, 0, None)] * 8, None, 2)
    tokens = torch.cat((many.tokens, many.tokens[:1]))
    with pytest.raises(InvalidSlotError, match=r"row 8: slot=8"):
        group.prefill(tokens, torch.cat((many.table, many.table[:1])), [10] * 9)


def test_a_traced_call_is_preflighted_on_every_lane_before_any_runs(tiny_model):
    """Lane 0 warmed, lane 1 not: mode='traced' names lane 1 and lane 0 replays nothing; warmed, traced equals eager."""
    group = make_group(tiny_model, 2)
    call = group_call([(40, 0, None), (100, 0, SamplingParams.greedy()), (20, 0, None)], (0, PER_LANE, 1), 2)
    lane0 = group.lanes[0]
    lane0.warm_up(WarmupManifest().observe(lane0.runtime.prepare(**call.lane_kwargs(call.routes[0])).requests))
    before = pool_of(lane0.runtime)
    with pytest.raises(TraceCoverageError, match=r"lane 1 \(caller rows \[1\]\).*no lane ran"):
        group.prefill(**call.kwargs(), mode="traced")
    assert [t.replays for t in lane0.runtime.captured_traces()] == [0] * len(lane0.runtime.captured_traces())
    assert changed_blocks(before, pool_of(lane0.runtime)) == set()
    lane1 = group.lanes[1]
    lane1.warm_up(WarmupManifest().observe(lane1.runtime.prepare(**call.lane_kwargs(call.routes[1])).requests))
    eager = make_group(tiny_model, 2).prefill(**call.kwargs(), mode="eager")
    assert group.prefill(**call.kwargs(), mode="traced") == eager
    group.close()
    assert all(lane.runtime.backend.ledger.live() == [] for lane in group.lanes)


def test_lanes_must_share_a_lane_size_and_own_their_runtime_and_pool(tiny_model):
    """Lanes of 4 and 8 slots, or one runtime twice, are configuration errors naming the lanes."""
    a, b = lane_runtime(tiny_model, 0), lane_runtime(tiny_model, 1, lane_size=8)
    with pytest.raises(PrefillConfigError, match=r"same policy.lane_size; lanes have \[4, 8\]"):
        LaneGroup([PrefillExecutor(a), PrefillExecutor(b)])
    with pytest.raises(PrefillConfigError, match="lanes 0 and 1 share one runtime"):
        LaneGroup([PrefillExecutor(a), PrefillExecutor(a)])
    with pytest.raises(PrefillConfigError, match="at least one lane"):
        LaneGroup([])


def test_in_turn_issues_every_lane_before_a_readback_and_leaves_one_unread_invocation_per_lane(tiny_model):
    """In turn: each round invokes every lane, then reads; a lane never holds two unread invocations."""
    group = make_group(tiny_model, 2, threaded=False)
    events = []
    for lane, executor in enumerate(group.lanes):
        runtime = executor.runtime
        invoke, stream = runtime.invoke, runtime.stream

        def logged_invoke(*args, _lane=lane, _invoke=invoke, **kwargs):
            events.append(("issue", _lane))
            return _invoke(*args, **kwargs)

        def logged_stream(invocations, _lane=lane, _stream=stream):
            events.append(("read", _lane))
            return _stream(invocations)

        runtime.invoke, runtime.stream = logged_invoke, logged_stream
    # lane 0: a chunked row and a lone sampled row (two requests); lane 1: one row
    rows = [(100, 0, None), (20, 0, None), (30, 0, SamplingParams(top_k=3, seed=1))]
    group.prefill(**group_call(rows, (0, PER_LANE, 1), 2).kwargs())
    assert events == [("issue", 0), ("issue", 1), ("read", 0), ("read", 1), ("issue", 0), ("read", 0)]
