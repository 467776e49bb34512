"""Which positions a step computes for a row: the one rule, shared by planning, scoring and the rule table.

Theory of operation
-------------------
A row of ``length`` prompt tokens arrives with its first ``cached`` positions
already in the KV cache, ``cached`` anywhere in ``[0, length]`` (a serving
engine's token budget cuts prompts at arbitrary positions, so ``cached`` is
rarely a multiple of the block size ``bs``).

1. **Padded steps start on a block.** A device-shaped (padded) step computes
   positions ``[computed_start, length)`` where ``computed_start`` is the
   start of the block holding position ``min(cached, length - 1)``. Every
   device chunk start is therefore a multiple of ``bs``: tt-metal's paged
   fill writes whole blocks from a block-aligned start, and its chunked SDPA
   derives its query chunk from the chunk start's lowest set bit.
2. **The row's own partly written block is rewritten.** When ``cached`` lies
   inside a block, positions ``[computed_start, cached)`` are computed again
   from the row's tokens and written back over the values already there (the
   same positions of the same tokens: equal up to rounding, ~1e-5 in fp32,
   never bit-identical by promise).
3. **What a row writes.** A row with ``cached < length`` writes the blocks at
   columns ``[cached // bs, ceil(length / bs))`` of its page table: the
   block holding ``cached`` and every later one. A fully cached row
   (``cached == length``) still owes its last-token output: it re-runs its
   final block read-only and writes nothing.
4. **What a row reads as cached.** Every column before its first written
   one: whole blocks, each entirely inside the cached prefix. A block that
   another row maps is never written through rule 2, because the rule table
   refuses a batch where one row writes a block that another row reads
   unless the writer fills that whole block at the same column and runs
   first (``block_order``).
5. **Recomputed positions are counted**: ``recomputed_positions`` is what a
   step computes that the cache already held (``cached - computed_start``),
   so a plan's cost includes the unaligned-start recompute.

Packed (unpadded) steps, where a row's tokens need not start on a block,
may start exactly at ``cached``; nothing in this package builds them yet.
"""

from __future__ import annotations

from prefill_core.values.intmath import ceil_div

__all__ = ["computed_start", "recomputed_positions", "written_columns"]


def computed_start(length: int, cached: int, block_size: int) -> int:
    """First position a padded step computes: the start of the block holding ``min(cached, length - 1)``."""
    last_needed = min(cached, length - 1)
    return last_needed - last_needed % block_size


def recomputed_positions(length: int, cached: int, block_size: int) -> int:
    """Positions a padded step computes although the cache already holds them (rule 5)."""
    return cached - computed_start(length, cached, block_size)


def written_columns(length: int, cached: int, block_size: int) -> range:
    """Page-table columns the row's steps write (rule 3): empty for a fully cached row."""
    if cached >= length:
        return range(0)
    return range(cached // block_size, ceil_div(length, block_size))
