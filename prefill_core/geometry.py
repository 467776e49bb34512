"""Shared geometry rules for page-table widths, used by the planner and the manifest.

Keeping them in one place is what makes the warm-up manifest complete: the
manifest enumerates exactly the widths the planner can produce.
"""

from __future__ import annotations

from .policy import PrefillPolicy

__all__ = ["regular_table_width", "chunked_read_width", "chunked_fill_width"]


def regular_table_width(policy: PrefillPolicy, block_size: int, padded_length: int) -> int:
    """Width of a regular prefill's table: the padded length's blocks, rounded up."""
    return policy.table_width(padded_length // block_size)


def chunked_read_width(policy: PrefillPolicy, block_size: int, padded_length: int, chunk_length: int) -> int:
    """Width of a chunked request's full-request (read) table.

    A chunk may start at any block-aligned cached offset, so the last one can
    overhang the padded length by up to ``chunk_length - block_size``.
    """
    return policy.table_width(padded_length // block_size + chunk_length // block_size - 1)


def chunked_fill_width(policy: PrefillPolicy, block_size: int, chunk_length: int) -> int:
    """Width of a chunk's fill-only (write) table."""
    return policy.table_width(chunk_length // block_size)
