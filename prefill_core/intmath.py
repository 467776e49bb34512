"""Exact integer helpers shared by every geometry rule (no float rounding anywhere)."""

from __future__ import annotations

__all__ = ["ceil_div", "ceil_div_column", "round_up"]


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for ints, exactly (``denominator > 0``)."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return ceil_div(value, multiple) * multiple


def ceil_div_column(numerators, denominator: int) -> list[int]:
    """``ceil_div`` of every value in a column, computed once per distinct value.

    Rows of a batch share a handful of lengths, so this is one dict lookup a
    row instead of one Python call a row.
    """
    of = {n: ceil_div(n, denominator) for n in set(numerators)}
    return list(map(of.__getitem__, numerators))
