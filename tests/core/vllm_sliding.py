"""vLLM's sliding-window prefix-cache rules, written from its ``SlidingWindowManager`` (v1
``single_type_kv_cache_manager.py``) as the oracle the core's window rules are checked against.
"""

from __future__ import annotations

from prefill_core.values.intmath import ceil_div


def contiguous_blocks_needed(window: int, block_size: int) -> int:
    """vLLM's ``sliding_window_contiguous_blocks``: the query itself is in the window, hence ``window - 1``."""
    return ceil_div(window - 1, block_size)


def longest_sliding_hit(cached: list[bool], window: int, block_size: int) -> int:
    """How many leading blocks a hit covers, given which blocks of the prompt the pool holds (``cached[i]``).

    Right to left, the first run of ``contiguous_blocks_needed`` held blocks
    ends the hit; without one, the run of held blocks from block 0 is the hit.
    """
    needed = contiguous_blocks_needed(window, block_size)
    run = 0
    for i in range(len(cached) - 1, -1, -1):
        if not cached[i]:
            run = 0
            continue
        run += 1
        if run >= needed:
            return i + run
    return run


def sliding_table_after_hit(
    hit: int, num_columns: int, window: int, block_size: int, *, null_block: int, first_id: int
) -> tuple[int, ...]:
    """The table vLLM builds for a hit of ``hit`` blocks: the null block before the window, real ids from there on."""
    first_real = max(0, hit - contiguous_blocks_needed(window, block_size))
    return tuple(null_block if j < first_real else first_id + j for j in range(num_columns))


def first_kept_after(computed: int, window: int, block_size: int) -> int:
    """``remove_skipped_blocks``: blocks before this column are freed once ``computed`` positions are done."""
    return max(0, computed - window + 1) // block_size
