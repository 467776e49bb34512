"""Result values handed to the caller: one ``PrefillResult`` per source row."""

from __future__ import annotations

from typing import Any

import attrs

from prefill_core import PreparedPrefill

from .ledger import DeviceTensor

__all__ = ["PrefillResult", "InvocationResult"]


@attrs.define(eq=False)
class PrefillResult:
    """The prefill output of one caller row: a plain record the caller owns.

    (Not frozen: a frozen attrs class costs twice as much to build, and the
    runtime keeps no reference to a result once it is handed out.)

    ``logits`` (float32 ``[V]``, host) when the row asked for no sampling;
    otherwise ``token``, its ``logprob`` under the model's raw distribution,
    and ``top_logprobs``: the row's ``num_logprobs`` best ``(token, logprob)``.
    """

    row: int
    logits: Any = None
    token: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class InvocationResult:
    """One request's device outputs plus the transients that stay owned until collection."""

    __slots__ = ("prepared", "outputs", "owned", "seeds", "consumed")

    def __init__(self, prepared: PreparedPrefill, outputs: dict[str, DeviceTensor], owned: list[DeviceTensor],
                 seeds: tuple[int, ...]):
        self.prepared = prepared
        self.outputs = outputs
        self.owned = owned
        self.seeds = seeds
        self.consumed = False
