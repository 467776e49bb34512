"""Per-row sampling parameters and the one-time sampling-path classification.

Paths, decided once per request at prepare time:

* ``logits``: no row asked for sampling; the program returns last-token logits.
* ``argmax``: every active row is greedy (temperature below
  ``GREEDY_TEMPERATURE`` or top_k 1) and the policy allows forced argmax.
* ``topk``: device sampling with per-row K/P/T (a single active row's values
  are broadcast to the whole wave on the device).
* ``host``: some row's top_k exceeds the device cap (or is 0: no limit); the program returns
  logits and the result collector samples on the host with the row's seed,
  so callers never meet an arbitrary device limit.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from prefill_core.values.errors import InvalidSamplingError, row_error

__all__ = [
    "GREEDY_TEMPERATURE",
    "SamplingParams",
    "SamplingPath",
    "classify_sampling",
    "distinct_params",
    "is_greedy",
    "refuse_per_row_extras",
]

GREEDY_TEMPERATURE = 1e-5
"""A temperature below this is greedy (vLLM's epsilon): 1/T would overflow sampling."""


def is_greedy(temperature: float, top_k: int) -> bool:
    """Whether a row with these parameters takes the argmax: the one greediness rule."""
    return temperature < GREEDY_TEMPERATURE or top_k == 1


class SamplingPath(enum.Enum):
    LOGITS = "logits"
    ARGMAX = "argmax"
    TOPK = "topk"
    HOST = "host"

    @property
    def returns_logits(self) -> bool:
        """Whether the device program's output is logits (the host may sample them)."""
        return self in (SamplingPath.LOGITS, SamplingPath.HOST)


@attrs.frozen
class SamplingParams:
    """How one row's first token is chosen.

    ``temperature`` is a finite number >= 0; any value below
    ``GREEDY_TEMPERATURE`` (1e-5, as in vLLM) means greedy: the row takes the
    argmax, because dividing logits by a tinier temperature overflows
    (1/T is inf in bfloat16 and float32 alike). ``top_k == 0`` means no
    top-k limit; ``top_p == 1`` no nucleus limit; ``seed None`` draws from
    the runtime's generator. ``num_logprobs`` is how many top log-probs to
    return beside the sampled token's own.

    ``prompt_logprobs`` asks for the log-probs of the row's own prompt
    tokens (``None``: none; ``n >= 0``: each scored token's log-prob plus
    the ``n`` most likely alternatives, as vLLM's ``prompt_logprobs=n``).
    The range is the request's, not the step geometry's: positions
    ``[prompt_start, length - 1)`` score tokens ``prompt_start + 1 ..
    length - 1``; ``prompt_start`` ``None`` means the row's cached offset,
    and it may lie anywhere in ``[cached, length - 1]``. Values are checked
    against their domains by the planner's rule table (``rules.RULES``), not
    here, so a bad value always names its row.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    num_logprobs: int = 0
    prompt_logprobs: int | None = None
    prompt_start: int | None = None

    @property
    def is_greedy(self) -> bool:
        """Whether the row takes the argmax: temperature below ``GREEDY_TEMPERATURE``, or top_k 1."""
        return is_greedy(self.temperature, self.top_k)

    @classmethod
    def greedy(
        cls, num_logprobs: int = 0, *, prompt_logprobs: int | None = None, prompt_start: int | None = None
    ) -> SamplingParams:
        return cls(
            temperature=0.0,
            top_k=1,
            num_logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_start=prompt_start,
        )


def distinct_params(sampling: tuple[SamplingParams | None, ...]) -> list[SamplingParams | None]:
    """Each distinct object of a sampling column once, in first-seen order.

    Rows usually share a handful of parameter objects, so a rule over the
    column is judged once per object rather than once per row.
    """
    return list({id(s): s for s in sampling}.values())


def classify_sampling(
    sampling: tuple[SamplingParams | None, ...], *, device_top_k_cap: int, allow_forced_argmax: bool
) -> SamplingPath:
    """The one sampling path of a wave whose active rows carry ``sampling``."""
    if all(s is None for s in sampling):
        return SamplingPath.LOGITS
    distinct = distinct_params(sampling)
    if any(s is None for s in distinct):
        # The planner never mixes logits rows with sampled rows in one wave.
        raise AssertionError("a wave mixes rows with and without sampling params")
    # top_k == 0 (whole vocabulary) is beyond any device top-k as well.
    if any(not s.is_greedy and (s.top_k == 0 or s.top_k > device_top_k_cap) for s in distinct):
        return SamplingPath.HOST
    if allow_forced_argmax and all(s.is_greedy for s in distinct):
        return SamplingPath.ARGMAX
    return SamplingPath.TOPK


def refuse_per_row_extras(rows: Sequence[int], sampling: Sequence[SamplingParams | None]) -> None:
    """Refuses a row asking top or prompt log-probs: a batch-shaped result (the shell's ``BatchResult``) holds one
    token and log-prob per row (``InvalidSamplingError`` naming the row and field). The one copy of the rule:
    the runtime, the assembler and the lane group all ask it."""

    for row, params in zip(rows, sampling):
        if not isinstance(params, SamplingParams):
            continue  # None asks for logits; anything else is the planner's to name
        if params.num_logprobs:
            field, value = "sampling.num_logprobs", params.num_logprobs
        elif params.prompt_logprobs is not None:
            field, value = "sampling.prompt_logprobs", params.prompt_logprobs
        else:
            continue
        rule = "a batch-shaped result holds one token and its log-prob per row: ask for it through prefill()"
        raise row_error(InvalidSamplingError, row, field, value, rule)
