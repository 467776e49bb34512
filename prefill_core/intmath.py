"""Exact integer helpers shared by every geometry rule (no float rounding anywhere)."""

from __future__ import annotations

__all__ = ["ceil_div", "round_up"]


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for ints, exactly (``denominator > 0``)."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return ceil_div(value, multiple) * multiple
