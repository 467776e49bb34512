"""A lane group converts the caller's list rows once: its lanes take the group's host rows, widths kept."""

from __future__ import annotations

import pytest

from prefill_core.values.errors import PrefillInputError
from prefill_shell.engine import batch_builder
from tests.lane_kit import PER_LANE, group_call, make_group


def _as_lists(call) -> dict:
    """The call with its tokens and page table as list rows of each row's own width (prompt, mapped blocks)."""
    tokens = [row[:n].tolist() for row, n in zip(call.tokens, call.lengths)]
    table = [[b for b in row.tolist() if b >= 0] for row in call.table]
    return {**call.kwargs(), "tokens": tokens, "page_table": table}


@pytest.fixture
def counted_rows(monkeypatch):
    """How many caller rows ``batch_builder`` converts (each list row of tokens or page_table is one)."""
    seen = [0]
    convert = batch_builder._caller_row

    def counting(field, row, item):
        seen[0] += 1
        return convert(field, row, item)

    monkeypatch.setattr(batch_builder, "_caller_row", counting)
    return seen


def test_list_rows_are_converted_once_on_the_lane_path_and_score_as_tensors(tiny_model, counted_rows):
    """Three list rows over two lanes: six row conversions (tokens and table once each; twelve before), and the
    results equal the same call given as tensors."""
    call = group_call([(40, 0, None), (20, 0, None), (50, 0, None)], (0, 1, PER_LANE), 2)
    want = make_group(tiny_model, 2).prefill(**call.kwargs())
    counted_rows[0] = 0
    got = make_group(tiny_model, 2).prefill(**_as_lists(call))
    assert counted_rows[0] == 2 * len(call.lengths)
    assert got == want


def test_a_list_row_shorter_than_its_prompt_is_still_refused_by_its_lane_naming_the_caller_row(tiny_model):
    """The widths travel with the group's rows: caller row 2 (lane 1's row 0) one token short is named."""
    call = group_call([(40, 0, None), (20, 0, None), (50, 0, None)], (0, 1, PER_LANE), 2)
    lists = _as_lists(call)
    lists["tokens"][2] = lists["tokens"][2][:-1]
    with pytest.raises(PrefillInputError, match=r"row 2: \(lane 1, its row 0\).*prompt length \(50 entries\)"):
        make_group(tiny_model, 2).prefill(**lists)
