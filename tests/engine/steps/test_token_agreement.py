"""``MatrixAgreement`` (the planner's token question answered from a call's tokens) equals a plain count over the
rows' lists, padding never counted as agreement."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import TokenAgreement
from prefill_shell.engine.steps.token_agreement import MatrixAgreement


def _count(mine: list[int], theirs: list[int], start: int) -> int:
    n = 0
    while start + n < min(len(mine), len(theirs)) and mine[start + n] == theirs[start + n]:
        n += 1
    return n


@st.composite
def _rows(draw):
    """2-6 rows over a 2-letter alphabet (so they agree often), right-padded with 0 or with a real token id."""
    rows = draw(st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=24), min_size=2, max_size=6))
    filler = draw(st.sampled_from([0, 1]))  # 1: padding that equals the tokens, which must still not count
    width = max(map(len, rows)) + draw(st.integers(0, 3))
    matrix = torch.full((len(rows), width), filler, dtype=torch.int64)
    for i, row in enumerate(rows):
        matrix[i, : len(row)] = torch.tensor(row)
    row = draw(st.integers(0, len(rows) - 1))
    others = [i for i in range(len(rows)) if i != row]
    start = draw(st.integers(0, len(rows[row]) - 1))
    return rows, matrix, row, others, start


@given(_rows())
def test_the_count_is_where_the_rows_first_differ_or_either_ends(case):
    rows, matrix, row, others, start = case
    agreement = MatrixAgreement(matrix, [len(r) for r in rows])
    assert isinstance(agreement, TokenAgreement)
    assert agreement.agreement(row, others, start) == [_count(rows[row], rows[o], start) for o in others]
