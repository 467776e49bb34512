"""Shared geometry rules for page-table widths, used by the planner and the manifest.

Keeping them in one place is what makes the warm-up manifest complete: the
manifest enumerates exactly the widths the planner can produce.
"""

from __future__ import annotations

from prefill_core.values.intmath import ceil_div
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy

__all__ = ["regular_table_width", "chunked_read_width", "chunked_fill_width"]


def regular_table_width(policy: PrefillPolicy, block_size: int, padded_length: int) -> int:
    """Width of a regular prefill's table: the padded length's blocks, rounded up."""
    return policy.table_width(padded_length // block_size)


def chunked_read_width(
    policy: PrefillPolicy, layout: PageTableLayout, chunk_length: int, block_size: int | None = None
) -> int:
    """Width of a chunked request's full-request (read) table: the layout's, for every row.

    It depends on the chunk length only, never on the row's length or cached
    offset, so every chunked row of one chunk length shares one trace (as in
    tt-metal, which stages its layout's canonical prefill width). A chunk
    starts before the layout's capacity, so it can overhang it by up to
    ``chunk_length - 1`` positions: tt-metal's ``capacity + max_chunk - 1``
    with the step's own chunk length in place of the max chunk. ``block_size``
    (default the layout's) is a KV group's own, for a model with several.
    """
    bs = layout.block_size if block_size is None else block_size
    return policy.table_width(ceil_div(layout.capacity + chunk_length - 1, bs))


def chunked_fill_width(policy: PrefillPolicy, block_size: int, chunk_length: int) -> int:
    """Width of a chunk's fill-only (write) table."""
    return policy.table_width(chunk_length // block_size)
