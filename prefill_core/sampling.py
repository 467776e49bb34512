"""Per-row sampling parameters and the one-time sampling-path classification.

Paths, decided once per request at prepare time:

* ``logits``: no row asked for sampling; the program returns last-token logits.
* ``argmax``: every active row is greedy and the policy allows forced argmax.
* ``topk``: device sampling with per-row K/P/T (a single active row's values
  are broadcast to the whole wave on the device).
* ``host``: some row's top_k exceeds the device cap (or is 0: no limit); the program returns
  logits and the result collector samples on the host with the row's seed,
  so callers never meet an arbitrary device limit.
"""

from __future__ import annotations

import enum
import math

import attrs

from .errors import InvalidSamplingError

__all__ = ["SamplingParams", "SamplingPath", "classify_sampling", "check_sampling", "distinct_params"]


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

    ``top_k == 0`` means no top-k limit; ``top_p == 1`` no nucleus limit;
    ``seed None`` draws from the runtime's generator. ``num_logprobs`` is how
    many top log-probs to return beside the sampled token's own.
    Values are checked against their domains by ``check_sampling`` (which
    knows the row index), not here, so a bad value always names its row.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    num_logprobs: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def greedy(cls, num_logprobs: int = 0) -> SamplingParams:
        return cls(temperature=0.0, top_k=1, num_logprobs=num_logprobs)


def _bad(row: int, field: str, value: object, rule: str) -> InvalidSamplingError:
    msg = f"row {row}: sampling.{field}={value!r} is invalid: {rule}"
    return InvalidSamplingError(msg, row=row, field=f"sampling.{field}")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: int | float) -> bool:
    """``math.isfinite`` that calls an int too large for a float infinite instead of raising."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_sampling(row: int, params: SamplingParams, max_logprobs: int) -> None:
    """Raises ``InvalidSamplingError`` naming ``row`` for the first bad field."""
    t, k, p = params.temperature, params.top_k, params.top_p
    if not _is_real(t) or not _is_finite(t) or t < 0:
        raise _bad(row, "temperature", t, "must be a finite number >= 0")
    if type(k) is not int or k < 0:
        raise _bad(row, "top_k", k, "must be an int >= 0 (0 = no limit)")
    if not _is_real(p) or not (0 < p <= 1):
        raise _bad(row, "top_p", p, "must be a number in (0, 1]")
    if params.seed is not None and (type(params.seed) is not int or not 0 <= params.seed < 2**63):
        raise _bad(row, "seed", params.seed, "must be None or an int in [0, 2**63)")
    n = params.num_logprobs
    if type(n) is not int or not 0 <= n <= max_logprobs:
        raise _bad(row, "num_logprobs", n, f"must be an int in [0, {max_logprobs}] (the policy's max_logprobs)")


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
    if sampling[0] is None and sampling.count(None) == len(sampling):  # identity hits: one C pass
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
