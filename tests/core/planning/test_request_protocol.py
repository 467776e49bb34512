"""The request protocol (request.py's module doc) and the one planning decision (execution.py).

Padded waves and packed steps answer the shell's questions the same way:
which positions of which caller row step ``i`` computes (``segments``) and
which blocks it writes (``written_blocks``), so the shell never asks which
kind it holds.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from prefill_core import (
    ExecutionMode,
    PackedRequest,
    PrefillRequest,
    execution_mode,
    plan_packed,
    plan_prefill,
    plans_packed,
    replays,
)
from prefill_core.values.errors import PrefillInputError
from prefill_core.values.intmath import ceil_div
from tests.strategies import cases

PROTOCOL = (
    "source_rows",
    "slots",
    "lengths",
    "cached",
    "blocks",
    "sampling",
    "kind",
    "padded_batch",
    "active_batch_size",
    "num_chunks",
    "read_table",
    "real_tokens",
    "computed_tokens",
    "segments",
    "written_blocks",
)


def _plans(case) -> dict[str, tuple[PrefillRequest | PackedRequest, ...]]:
    return {
        "padded": tuple(plan_prefill(case.batch, case.policy, case.layout)),
        "packed": tuple(plan_packed(case.batch, case.policy, case.layout)),
    }


@given(cases())
def test_both_kinds_write_exactly_each_rows_owed_blocks_over_the_call(case):
    """Over every step of either plan, a row's written blocks are its blocks [cached // bs, ceil(length / bs)),
    each written by one request only; a fully cached row writes none."""
    bs = case.layout.block_size
    for kind, requests in _plans(case).items():
        written: dict[int, list[int]] = {}
        for request in requests:
            for name in PROTOCOL:
                assert hasattr(request, name), (kind, name)
            for index in range(request.num_chunks):
                for row, blocks in request.written_blocks(index).items():
                    written.setdefault(row, []).extend(blocks)
        for row, (blocks, length, cached) in enumerate(zip(case.batch.blocks, case.batch.lengths, case.batch.cached)):
            owed = [] if cached == length else list(blocks[cached // bs : ceil_div(length, bs)])
            assert sorted(set(written.get(row, []))) == sorted(owed), (kind, row)


@given(cases())
def test_segments_compute_every_owed_position_and_end_at_the_rows_length(case):
    """Per caller row, the segments of either plan cover [cached, length) (packed: exactly once) and the last
    one ends at the row's length; a fully cached row re-runs at least its last position."""
    for kind, requests in _plans(case).items():
        seen: dict[int, list[tuple[int, int]]] = {}
        for request in requests:
            for index in range(request.num_chunks):
                for segment in request.segments(index):
                    if segment.length:
                        seen.setdefault(segment.row, []).append((segment.start, segment.end))
        for row, (length, cached) in enumerate(zip(case.batch.lengths, case.batch.cached)):
            spans = sorted(seen[row])
            covered = set().union(*(range(a, b) for a, b in spans))
            assert set(range(min(cached, length - 1), length)) <= covered, (kind, row)
            assert max(b for _, b in spans) == length, (kind, row)
            if kind == "packed":
                assert sum(b - a for a, b in spans) == len(covered), (kind, row)


@given(cases())
def test_a_padded_segment_lies_in_its_rows_hidden_block(case):
    """A wave's row b computes chunk positions at hidden rows [b * S, b * S + length): offsets never overlap."""
    for request in plan_prefill(case.batch, case.policy, case.layout):
        for index, chunk in enumerate(request.chunks):
            segments = request.segments(index)
            assert [s.row for s in segments] == list(request.source_rows)
            for b, segment in enumerate(segments):
                assert segment.offset == b * chunk.length and segment.start == chunk.start
                assert 0 <= segment.length <= chunk.length


@pytest.mark.parametrize(
    ("lane", "mode", "captured", "packed"),
    [
        (True, ExecutionMode.EAGER, False, True),
        (True, ExecutionMode.EAGER, True, True),
        (True, ExecutionMode.AUTO, False, True),
        (True, ExecutionMode.AUTO, True, False),  # it may replay: plan what a trace serves
        (True, ExecutionMode.TRACED, False, False),
        (True, ExecutionMode.TRACED, True, False),
        (False, ExecutionMode.EAGER, False, False),
        (False, ExecutionMode.AUTO, False, False),
    ],
)
def test_a_call_that_may_replay_is_planned_padded(lane, mode, captured, packed):
    assert plans_packed(lane, mode, captured) is packed


def test_replays_only_when_traced_or_auto_and_covered():
    assert [replays(m, covered) for m in ExecutionMode for covered in (False, True)] == [
        False,
        True,  # auto
        False,
        False,  # eager
        True,
        True,  # traced: an uncovered call is refused, never run eagerly
    ]


@pytest.mark.parametrize("value", ["Traced", "trace", True, None, 1])
def test_a_mode_outside_the_three_is_a_named_error(value):
    with pytest.raises(PrefillInputError, match="mode=") as info:
        execution_mode(value)
    assert info.value.field == "mode"


def test_modes_are_their_strings():
    assert [execution_mode(m.value) for m in ExecutionMode] == list(ExecutionMode)
    assert execution_mode("traced") is ExecutionMode.TRACED
