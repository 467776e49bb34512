"""``route_to_lanes``: rows go to lane ``slot // per_lane_batch`` at slot ``slot % per_lane_batch``, in caller order."""

from __future__ import annotations

import pytest
from hypothesis import given

from prefill_core import InvalidSlotError, LaneRoute, route_to_lanes
from tests.strategies import lane_calls


@given(lane_calls())
def test_every_row_lands_once_in_the_lane_owning_its_slot(call):
    """Each caller row appears in exactly one route, in the lane and at the local slot its group slot names."""
    num_lanes, per_lane, num_rows, slots = call
    routes = route_to_lanes(slots, num_rows, per_lane, num_lanes)
    group_slots = range(num_rows) if slots is None else slots
    seen = sorted(row for route in routes for row in route.source_rows)
    assert seen == list(range(num_rows))
    for route in routes:
        for row, local in zip(route.source_rows, route.slots, strict=True):
            assert route.lane == group_slots[row] // per_lane
            assert local == group_slots[row] % per_lane
            assert 0 <= local < per_lane


@given(lane_calls())
def test_routes_keep_caller_order_within_a_lane_and_come_in_lane_order(call):
    """Rows of a lane keep their caller order, lanes ascend and no route is empty."""
    num_lanes, per_lane, num_rows, slots = call
    routes = route_to_lanes(slots, num_rows, per_lane, num_lanes)
    assert [r.lane for r in routes] == sorted({r.lane for r in routes})
    assert all(r.source_rows and list(r.source_rows) == sorted(r.source_rows) for r in routes)
    assert all(len(set(r.slots)) == len(r.slots) for r in routes)


def test_vllm_data_parallel_slots_route_each_rank_to_its_lane():
    """Slots ``dp_rank * 16 + i`` from ranks 1 and 0, mixed, land in lanes 1 and 0 at slot ``i``."""
    slots = (16 + 3, 0 + 5, 16 + 0, 0 + 15, 16 + 15)
    routes = route_to_lanes(slots, 5, 16, 2)
    assert routes == (LaneRoute(0, (1, 3), (5, 15)), LaneRoute(1, (0, 2, 4), (3, 0, 15)))


def test_without_slots_rows_take_slots_range_b():
    """20 rows without slots on 2 lanes x 16 fill lane 0 (slots 0-15) and then lane 1 (0-3)."""
    routes = route_to_lanes(None, 20, 16, 2)
    assert routes == (
        LaneRoute(0, tuple(range(16)), tuple(range(16))),
        LaneRoute(1, tuple(range(16, 20)), (0, 1, 2, 3)),
    )


@pytest.mark.parametrize(
    "slots, num_rows, row, value",
    [
        ((0, 32), 2, 1, 32),  # past the last lane
        ((0, -1), 2, 1, -1),
        ((4, 4), 2, 1, 4),  # one slot twice
        ((0, True), 2, 1, True),  # a bool is not a slot
        (None, 33, 32, 32),  # more rows than the group's slots
    ],
)
def test_a_bad_slot_is_named_by_caller_row(slots, num_rows, row, value):
    """A slot outside the group, repeated, or not an int raises ``InvalidSlotError`` naming the row and value."""
    with pytest.raises(InvalidSlotError, match=rf"row {row}: slot={value!r}") as caught:
        route_to_lanes(slots, num_rows, 16, 2)
    assert (caught.value.row, caught.value.field) == (row, "slot")


def test_a_slot_count_unlike_the_row_count_is_refused():
    """Three slots for two rows is an ``InvalidSlotError`` on the call's ``slots``."""
    with pytest.raises(InvalidSlotError, match="one slot per row"):
        route_to_lanes((0, 1, 2), 2, 16, 2)
