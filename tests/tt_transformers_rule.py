"""tt-transformers' batched-prefill rule, written from its documented semantics (not its code): a test oracle.

What its planner does with one call's rows, counted as steps and positions.
Upstream (read for facts; none of its code is here), repository
``tenstorrent/tt-transformers``:

* the planner: ``src/tt_transformers/llm_runtime/prefill/plan.py`` at
  commit 9e524fed556c21988d1c0e1f75e0cf32969b75c9 (``_plan_prefill_requests``,
  ``_batched_prefill_size``, ``_plan_chunks``);
* the policy: ``src/tt_transformers/llm_runtime/prefill/config.py`` at
  commit afaba6b042fb084886524ff287bf29b464f4d69b (``BatchedPrefillPolicy.default``).

The rule:

* A row's work is its uncached part ``u = length - cached`` (cached is
  block aligned there); a row with ``u == 0`` runs nothing and returns no
  output. Rows bucket by ``rung(u)`` (128, 1024, then powers of two).
* A bucket runs as one wave of the smallest physical size >= its rows when
  all of: it has >= ``minimum_active_rows`` rows, batching is on (the model
  declares it, ``DISABLE_BATCHED_PREFILL`` unset), sampling does not need a
  batched output the runtime lacks, no row is cached unless
  ``allow_cached_prefix``, ``rung <= maximum_sequence_length``, such a size
  exists, it is <= ``maximum_physical_batch`` and the lane's rows, and
  ``size * rung < maximum_total_tokens``. A bucket is never split: failing
  any of these, every row of it runs alone.
* Alone, a row runs ``rung(u)`` positions in one step when that fits the
  max chunk and it is uncached; otherwise chunks from its cached offset of
  ``rung(u)`` (or, past the max chunk, the largest multiple of 2048 <= the
  max chunk dividing it), stopping after the chunk holding its last token.

The call's sampling is call-wide there (one ``sampling_params`` or none).
"""

from __future__ import annotations

import attrs

__all__ = ["TtTransformersPolicy", "GALAXY", "tt_rung", "tt_transformers_cost"]


@attrs.frozen
class TtTransformersPolicy:
    physical_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    minimum_active_rows: int = 2
    maximum_physical_batch: int = 8
    maximum_sequence_length: int = 2048
    maximum_total_tokens: int = 128 * 1024
    allow_cached_prefix: bool = False


GALAXY = TtTransformersPolicy(
    physical_batch_sizes=(32,), minimum_active_rows=16, maximum_physical_batch=32, maximum_sequence_length=2048
)
"""The Galaxy brief in tt-metal's sources (a synthetic test harness)."""


def tt_rung(n: int) -> int:
    if n <= 128:
        return 128
    if n <= 1024:
        return 1024
    return 1 << (n - 1).bit_length()


def _chunk(rung: int, max_chunk: int) -> int:
    if rung <= max_chunk:
        return rung
    return next(c for c in range(max_chunk - max_chunk % 2048, 0, -2048) if rung % c == 0)


def _wave_size(rows: list[int], cached: list[int], rung: int, policy: TtTransformersPolicy, lane: int) -> int | None:
    if len(rows) < policy.minimum_active_rows:
        return None
    if not policy.allow_cached_prefix and any(cached[r] for r in rows):
        return None
    if rung > policy.maximum_sequence_length:
        return None
    size = next((s for s in policy.physical_batch_sizes if s >= len(rows)), None)
    if size is None or size > policy.maximum_physical_batch or size > lane:
        return None
    return size if size * rung < policy.maximum_total_tokens else None


def tt_transformers_cost(
    lengths: list[int],
    cached: list[int],
    policy: TtTransformersPolicy,
    *,
    max_chunk: int = 2048,
    lane: int = 32,
    batching: bool = True,
    sampled_fallback: bool = False,
) -> tuple[int, int]:
    """``(positions, steps)`` tt-transformers' rule runs for one call of rows ``(length, cached)``.

    ``batching`` False: the model declares no batched prefill, or
    ``DISABLE_BATCHED_PREFILL`` is set. ``sampled_fallback``: the call
    samples and needs a batched output the runtime lacks (singles).
    """
    buckets: dict[int, list[int]] = {}
    for row, (length, done) in enumerate(zip(lengths, cached)):
        if length > done:
            buckets.setdefault(tt_rung(length - done), []).append(row)
    positions = steps = 0
    for rung, rows in buckets.items():
        size = None if not batching or sampled_fallback else _wave_size(rows, cached, rung, policy, lane)
        if size is not None:
            positions, steps = positions + size * rung, steps + 1
            continue
        for row in rows:
            work = lengths[row] - cached[row]
            chunk = _chunk(rung, max_chunk)
            count = -(-work // chunk)
            positions, steps = positions + count * chunk, steps + count
    return positions, steps
