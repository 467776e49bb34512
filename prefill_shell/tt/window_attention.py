"""One KV group's chunked attention on ttnn: the group's window passed as ``sliding_window_size``.

A TTTv2 model of a hybrid checkpoint runs each layer's chunked prefill
attention through its KV group's read table (``contract.GROUP_READ_TABLES``,
staged by ``staging.py``: group g's ``[B, W]`` rows off the leading
dimension) and that group's window: ttnn 0.81.1's
``transformer.chunked_scaled_dot_product_attention`` takes it as
``sliding_window_size`` (each query at p sees keys ``(p - window, p]``,
``prefill_core.kv_groups.windows``' rule; ``tests/tt/test_window_golden.py`` checks the
op's golden against it). A full-attention group passes no window.

What the op reads: its golden gathers every read-table entry before masking
(the same test pins it), so the entries outside a window, the filler 0 our
tables hold there, must name a block holding finite values; the core never
names a stale or foreign block there (``group_tables`` rule 2).
"""

from __future__ import annotations

from typing import Any

from prefill_core import KVGroup

__all__ = ["group_chunked_attention"]


def group_chunked_attention(
    ttnn: Any, q: Any, k_cache: Any, v_cache: Any, read_table: Any, chunk_start: Any, group: KVGroup, **options: Any
) -> Any:
    """``q [B, H, S, D]`` over group ``group``'s paged K/V from the device tensor ``chunk_start``, in its window.

    ``options`` (``scale``, ``program_config``, ``compute_kernel_config``) pass through unchanged.
    """
    window = {} if group.window is None else {"sliding_window_size": group.window}
    return ttnn.transformer.chunked_scaled_dot_product_attention(
        q, k_cache, v_cache, read_table, chunk_start_idx_tensor=chunk_start, **window, **options
    )
