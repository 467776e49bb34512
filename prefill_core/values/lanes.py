"""Data-parallel lanes: which lane serves each row of a call, and at which slot.

A lane group holds ``num_lanes`` lanes of ``per_lane_batch`` KV slots each;
the group's slots are numbered ``0 .. num_lanes * per_lane_batch - 1``, lane
by lane, the numbering vLLM's data-parallel ranks use for ``empty_slots``
(``dp_rank * per_lane_batch + i``). Rules:

* a row with group slot ``s`` goes to lane ``s // per_lane_batch`` at the
  lane's own slot ``s % per_lane_batch``;
* a call without slots uses slots ``0 .. B-1`` (``range(B)``), as tt-metal
  does, so it fills lane 0 first;
* slots are ints in ``[0, num_lanes * per_lane_batch)`` and unique within a
  call; anything else is an ``InvalidSlotError`` naming the caller row;
* each lane's rows keep the caller's relative order; lanes come in lane
  order, and only lanes with rows appear; ``source_rows`` maps a lane's row
  ``i`` back to the caller's row, so results merge back in caller order.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from prefill_core.values.errors import InvalidSlotError, PrefillInputError, field_error

__all__ = ["LaneRoute", "route_to_lanes"]


@attrs.frozen
class LaneRoute:
    """The rows of one call that lane ``lane`` serves: caller rows and lane-local slots, in caller order."""

    lane: int
    source_rows: tuple[int, ...]
    slots: tuple[int, ...]


def _check_geometry(per_lane_batch: int, num_lanes: int) -> None:
    for field, value in (("per_lane_batch", per_lane_batch), ("num_lanes", num_lanes)):
        if type(value) is not int or value <= 0:
            raise field_error(PrefillInputError, "lane group", field, value, "must be a positive int")


def route_to_lanes(
    slots: Sequence[int] | None, num_rows: int, per_lane_batch: int, num_lanes: int
) -> tuple[LaneRoute, ...]:
    """Routes a call's ``num_rows`` rows to lanes by group slot (``range(num_rows)`` when ``slots`` is None)."""
    _check_geometry(per_lane_batch, num_lanes)
    group_slots = tuple(range(num_rows)) if slots is None else tuple(slots)
    if len(group_slots) != num_rows:
        rule = f"must hold one slot per row ({num_rows} rows)"
        raise field_error(InvalidSlotError, "call", "slots", f"{len(group_slots)} slots", rule)
    capacity = per_lane_batch * num_lanes
    owner: dict[int, int] = {}
    rows: list[list[int]] = [[] for _ in range(num_lanes)]
    local: list[list[int]] = [[] for _ in range(num_lanes)]
    for row, slot in enumerate(group_slots):
        if type(slot) is not int or not 0 <= slot < capacity:
            rule = (
                f"must be an int in [0, {capacity}): {num_lanes} lanes x {per_lane_batch} slots, "
                f"lane = slot // {per_lane_batch}"
            )
            raise InvalidSlotError(f"row {row}: slot={slot!r} is invalid: {rule}", row=row, field="slot")
        if slot in owner:
            rule = f"row {owner[slot]} holds it already"
            raise InvalidSlotError(f"row {row}: slot={slot!r} is invalid: {rule}", row=row, field="slot")
        owner[slot] = row
        lane = slot // per_lane_batch
        rows[lane].append(row)
        local[lane].append(slot % per_lane_batch)
    return tuple(LaneRoute(lane, tuple(rows[lane]), tuple(local[lane])) for lane in range(num_lanes) if rows[lane])
