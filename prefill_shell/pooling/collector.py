"""The one runtime-facing piece of pooling: rows in, each row's pooled final hidden states out.

``pooled_call`` is one ``PrefillRuntime.prefill`` whose call asks for pooled
outputs (``PrefillCall.pooling``: a ``PoolingType`` per row): the runtime
pools each row's final hidden states across the steps that compute it
(``engine.steps.pooled_states``, the core's ``pooled_positions``), eager or
replaying traces, and returns them as ``PrefillResult.pooled`` beside the
row's last-token logits. Everything above it (applying the heads, rounds,
prefix sharing) is the pooling layer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from prefill_core.values.pooling import PoolingType

__all__ = ["PooledCall", "pooled_call"]


class PooledCall(NamedTuple):
    results: list  # PrefillResult per caller row (last-token logits and ``pooled``)
    pooled: torch.Tensor  # float32 [rows, hidden]


def pooled_call(
    runtime, tokens, page_table, lengths, cached, types: Sequence[PoolingType], *, mode="auto", on_progress=None
) -> PooledCall:
    """Runs one call with every row pooled as ``types[row]`` says; results and the stacked vectors."""
    results = runtime.prefill(
        tokens, page_table, lengths, cached, mode=mode, on_progress=on_progress, pooling=list(types)
    )
    pooled = torch.stack([r.pooled for r in results]) if results else torch.empty(0)
    return PooledCall(results, pooled)
