"""Result values handed to the caller: one ``PrefillResult`` per source row."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from prefill_core import PreparedPrefill

from .ledger import DeviceTensor

__all__ = ["PrefillResult", "InvocationResult"]


def _same_logits(a: Any, b: Any) -> bool:
    """Logits compare by value (shape, dtype and every element; NaN equals NaN)."""
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


@attrs.frozen
class PrefillResult:
    """The prefill output of one caller row.

    ``logits`` (float32 ``[V]``, a host copy the caller owns) when the row
    asked for no sampling; otherwise ``token``, its ``logprob`` under the
    model's raw distribution, and ``top_logprobs``: the row's
    ``num_logprobs`` best ``(token, logprob)``. Results compare with ``==``
    (logits by value), so eager and traced results can be compared directly.
    """

    row: int
    logits: Any = attrs.field(default=None, eq=attrs.cmp_using(eq=_same_logits), hash=False)
    token: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class InvocationResult:
    """One request's device outputs plus the transients that stay owned until collection."""

    __slots__ = ("prepared", "outputs", "owned", "seeds", "consumed")

    def __init__(self, prepared: PreparedPrefill, outputs: dict, owned: list[DeviceTensor],
                 seeds: tuple[int, ...]):
        self.prepared = prepared
        self.outputs = outputs
        self.owned = owned
        self.seeds = seeds
        self.consumed = False
