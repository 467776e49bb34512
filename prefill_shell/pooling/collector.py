"""The one runtime-facing piece of pooling: rows in, each row's pooled final hidden states out.

``pooled_call`` is one ``PrefillRuntime.run`` of a call that asks for pooled
outputs (``PrefillCall.pooling``: a ``PoolingType`` per row): the runtime
pools each row's final hidden states across the steps that compute it
(``engine.steps.pooled_states``, the core's ``pooled_positions``), eager or
replaying traces, and returns them as ``PrefillResult.pooled`` beside the
row's last-token logits, and the positions its plan computes (rows that
begin alike share some). Everything above it (applying the heads, rounds,
prefix sharing) is the pooling layer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from prefill_core.values.pooling import PoolingType
from prefill_shell.engine.call import PrefillCall

__all__ = ["PooledCall", "pooled_call"]


class PooledCall(NamedTuple):
    results: list  # PrefillResult per caller row (last-token logits and ``pooled``)
    pooled: torch.Tensor  # float32 [rows, hidden]
    computed: int  # positions the call's plan computes (rows that begin alike share some: shared spans)


def pooled_call(
    runtime, tokens, page_table, lengths, cached, types: Sequence[PoolingType], *, mode="auto", on_progress=None
) -> PooledCall:
    """Runs one call with every row pooled as ``types[row]`` says; results and the stacked vectors."""
    call = PrefillCall.of(tokens, page_table, lengths, cached, mode=mode, on_progress=on_progress, pooling=list(types))
    batch = runtime.prepare_call(call)
    results = runtime.run_prepared(batch, call)
    computed = sum(p.request.computed_tokens for p in batch.requests)
    pooled = torch.stack([r.pooled for r in results]) if results else torch.empty(0)
    return PooledCall(results, pooled, computed)
