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
    """``ceil_div`` of every value in a column.

    The division written out in one comprehension: a column is divided on
    every planning call, and a call per row would cost more than the
    arithmetic.
    """
    return [-(-n // denominator) for n in numerators]
