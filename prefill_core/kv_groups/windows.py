"""What a step of one KV group reads and writes: the window rule, in positions and page-table columns.

Theory of operation
-------------------
Let ``W`` be a sliding group's window and ``bs`` its block size; a full
group has no window (``None``), which every rule below reads as an infinite
one.

1. **Visibility** (transformers' ``sliding_window_overlay`` and vLLM's
   ``SlidingWindowSpec``): a query at position q sees keys k with
   ``q - W < k <= q``, i.e. ``[window_floor(q), q]``.
2. **A step's reads.** A step computing ``[start, end)`` reads keys
   ``[window_floor(start), end)``: its own fresh keys ``[start, end)`` and
   the cached ones ``[window_floor(start), start)``, gathered from the pool
   columns ``prefix_columns(start)``. No other column of the table is read.
3. **A row's floor** (vLLM's ``remove_skipped_blocks``): once a row has
   ``c`` positions computed, its blocks before column
   ``window_floor(c) // bs`` may be freed and handed to another request,
   their table entries left stale (the v1 runner and the Tenstorrent plugin
   only append) or set to the null block. ``kept_columns`` is what stays
   mapped for a row owing positions from ``c = min(cached, length - 1)``:
   from ``window_floor(c) // bs`` to its last block. A step never reads a
   column before it (``read_columns`` clips there).
4. **A step's writes**: only the blocks holding its own positions
   (``computed_positions.written_columns``), never one before its start.
   A padded step that starts inside a block (``start < cached``) takes the
   K/V of its positions ``[start, cached)`` from the pool (``reused_span``)
   instead of recomputing them: their queries' windows may reach below the
   floor, so a recomputed key there could not be trusted, and the row's
   partly cached block is then rewritten with the bytes it held.
5. **A cached prefix is valid** (vLLM's ``SlidingWindowManager`` hit rule)
   when every kept column before the first written one is mapped to a real
   block; every earlier column may hold anything, and its contents never
   reach an output.

For ``cached`` a multiple of ``bs``, rule 3's first kept column is
``cached // bs - ceil((W - 1) / bs)``: exactly the blocks vLLM's hit keeps
(``sliding_window_contiguous_blocks``).
"""

from __future__ import annotations

from prefill_core.values.intmath import ceil_div

__all__ = [
    "window_floor",
    "read_span",
    "prefix_columns",
    "kept_columns",
    "read_columns",
    "reused_span",
    "positions_read",
    "hit_blocks_needed",
]


def window_floor(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` sees (rule 1): ``max(0, position - window + 1)``."""
    if window is None:
        return 0
    return max(0, position - window + 1)


def read_span(start: int, end: int, window: int | None) -> range:
    """Key positions a step computing ``[start, end)`` reads (rule 2)."""
    return range(window_floor(start, window), end)


def prefix_columns(start: int, window: int | None, block_size: int) -> range:
    """Pool columns a step starting at ``start`` gathers cached keys from (rule 2): none when nothing is cached."""
    return range(window_floor(start, window) // block_size, ceil_div(start, block_size))


def kept_columns(length: int, cached: int, window: int | None, block_size: int) -> range:
    """Columns a row's steps may read or write (rule 3): from its floor to its last block; the rest is never touched."""
    return range(window_floor(min(cached, length - 1), window) // block_size, ceil_div(length, block_size))


def read_columns(start: int, end: int, floor_column: int, window: int | None, block_size: int) -> range:
    """Columns a step of ``[start, end)`` reads through its table: its window's, clipped at the row's floor (rule 3)."""
    first = max(window_floor(start, window) // block_size, floor_column)
    return range(first, ceil_div(end, block_size))


def reused_span(start: int, end: int, cached: int, floor_column: int, block_size: int) -> range:
    """Positions of a step whose K/V come from the pool (rule 4): ``[start, cached)`` above the floor."""
    return range(max(start, floor_column * block_size), max(min(cached, end), start))


def positions_read(start: int, end: int, window: int | None) -> int:
    """How many key positions the queries of ``[start, end)`` read in all (rule 1, summed).

    A query at q reads ``min(q + 1, W)`` keys, so a sliding layer's step
    costs at most ``(end - start) * W`` whatever the prompt length, a full
    layer's grows with the positions before it.
    """
    return _keys_before(end, window) - _keys_before(start, window)


def _keys_before(n: int, window: int | None) -> int:
    """Keys read by the queries at ``[0, n)``: the sum of ``min(q + 1, W)``."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def hit_blocks_needed(window: int, block_size: int) -> int:
    """Blocks a sliding group's prefix-cache hit needs mapped before the first new position (vLLM's count)."""
    return ceil_div(window - 1, block_size)
