"""Result values handed to the caller: one ``PrefillResult`` per source row."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from prefill_core import PreparedPrefill

from .ledger import DeviceTensor

__all__ = ["PrefillResult", "InvocationResult"]


def _same_logits(a: Any, b: Any) -> bool:
    """Logits compare by value (shape, dtype and every element; NaN equals NaN)."""
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


class PrefillResult(NamedTuple):
    """The prefill output of one caller row: an immutable value.

    ``logits`` (float32 ``[V]``, a host copy the caller owns) when the row
    asked for no sampling; otherwise ``token``, its ``logprob`` under the
    model's raw distribution, and ``top_logprobs``: the row's
    ``num_logprobs`` best ``(token, logprob)``. ``prompt_logprobs``: when the
    row asked for them (``SamplingParams.prompt_logprobs``), one
    ``prompt_logprobs.PromptLogprob`` per scored prompt token, in position
    order. Results compare with ``==``
    (logits by value), so eager and traced results can be compared directly.
    A named tuple rather than a frozen attrs class: the assembler builds one
    per row of every call, and a tuple is the cheapest immutable value.
    """

    row: int
    logits: Any = None
    token: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: tuple = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrefillResult):
            return NotImplemented
        return self[0] == other[0] and self[2:] == other[2:] and _same_logits(self[1], other[1])

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:  # logits are left out: equal results hash alike
        return hash((self[0], *self[2:]))


class InvocationResult:
    """One request's device outputs plus the transients that stay owned until collection."""

    __slots__ = ("prepared", "outputs", "owned", "seeds", "consumed", "prompt")

    def __init__(
        self,
        prepared: PreparedPrefill,
        outputs: dict,
        owned: list[DeviceTensor],
        seeds: tuple[int, ...],
        prompt: dict[int, list] | None = None,
    ):
        self.prepared = prepared
        self.outputs = outputs
        self.owned = owned
        self.seeds = seeds
        self.consumed = False
        self.prompt = prompt  # physical row -> its PromptLogprob entries (host values, already read)
