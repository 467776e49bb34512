"""Static prefill policy and the pure geometry rules derived from it.

Theory of operation
-------------------
A policy is every planning choice that tt-metal hard-codes, made a field:

* Padded length: the first ladder rung >= n, else the next power of two
  (tt-metal's ladder is 128, 1024, then powers of two).
* Chunk length for P padded tokens of work (``chunk_length``): P itself when
  it fits ``max_chunk_length``; otherwise the largest multiple of
  ``chunk_quantum`` (tt-metal's 2048) that is <= ``max_chunk_length`` and
  divides P; failing that, the largest such multiple of the block size
  (which always exists: the block size divides every rung and the max
  chunk). No step is ever longer than ``max_chunk_length``.
* Wave: the smallest supported wave >= the active row count. A bucket's
  largest usable wave also respects ``max_batch_size``, ``lane_size`` and
  ``padded_batch * padded_length < max_batched_tokens``.
  A bucket's last, partial wave is padded up (``pad_partial_waves``, tt-metal's
  choice: fewer invocations) or split into exact smaller waves (no padding
  rows: better where every padded row is real work, as on a CPU).
* Page-table widths are rounded up to ``table_width_multiple`` (8).
* Wave admission (tt-transformers' ``BatchedPrefillPolicy``): a wave never
  holds fewer than ``min_active_rows`` real rows (a bucket, or a split
  piece, with fewer runs as singles); a wave's padded length is at most
  ``max_wave_length`` (``None``: the max chunk); a sampled bucket's waves
  hold at most ``max_sampled_wave`` rows (``None``: no cap; 1: singles, the
  fallback for a backend without a batched sampled output). With
  ``split_oversize_buckets`` False a bucket larger than its largest usable
  wave runs as singles (tt-transformers never splits a bucket); with
  ``isolate_cached_buckets`` a bucket of the uncached work's rung that holds
  a cached row runs every row alone (tt-transformers' rule when cached rows
  may not batch). ``batch_cached_rows``: cached rows that share a computed
  start and a one-step length run as one chunked wave, each from its own
  block-aligned start (``plan.py`` rule 3b). ``from_tt_transformers`` maps
  a tt-transformers policy's fields onto these.
* ``packed_steps``: plan packed steps (``packed.py``: real tokens only, up to
  ``max_chunk_length`` a step) where the backend and the model declare they
  can run them; otherwise, and always for traced calls, padded waves.
"""

from __future__ import annotations

import bisect
import math

import attrs

from prefill_core.values.errors import InvalidPolicyError, field_error
from prefill_core.values.intmath import ceil_div, round_up
from prefill_core.values.layout import PageTableLayout

__all__ = ["PrefillPolicy", "check_policy_fits_layout", "ceil_div", "round_up"]


def _fail(field: str, value: object, rule: str) -> InvalidPolicyError:
    return field_error(InvalidPolicyError, "PrefillPolicy", field, value, rule)


def _positive_int(instance, attribute, value):
    if type(value) is not int or value <= 0:
        raise _fail(attribute.name, value, "must be a positive int")


def _non_negative_int(instance, attribute, value):
    if type(value) is not int or value < 0:
        raise _fail(attribute.name, value, "must be a non-negative int")


def _bool(instance, attribute, value):
    if type(value) is not bool:
        raise _fail(attribute.name, value, "must be a bool")


def _is_power_of_two(value: int) -> bool:
    return type(value) is int and value > 0 and not value & (value - 1)


def _waves(instance, attribute, value):
    if not isinstance(value, tuple) or not value:
        raise _fail(attribute.name, value, "must be a non-empty tuple of ints")
    for wave in value:
        if not _is_power_of_two(wave):
            raise _fail(attribute.name, value, f"wave {wave!r} is not a power of two")
    if any(a >= b for a, b in zip(value, value[1:])):
        raise _fail(attribute.name, value, "waves must be strictly increasing")


def _ladder(instance, attribute, value):
    if not isinstance(value, tuple) or any(type(v) is not int for v in value):
        raise _fail(attribute.name, value, "must be a tuple of ints")
    if any(v <= 0 or v % instance.tile_size for v in value):
        raise _fail(attribute.name, value, f"every rung must be a positive multiple of tile_size={instance.tile_size}")
    if any(a >= b for a, b in zip(value, value[1:])):
        raise _fail(attribute.name, value, "ladder must be strictly increasing")


def _optional_positive_int(instance, attribute, value):
    if value is not None and (type(value) is not int or value <= 0):
        raise _fail(attribute.name, value, "must be None or a positive int")


def _optional_lengths(instance, attribute, value):
    if value is None:
        return
    if not isinstance(value, tuple) or any(type(v) is not int or v <= 0 for v in value):
        raise _fail(attribute.name, value, "must be None or a tuple of positive ints")


@attrs.frozen(cache_hash=True)  # a key of the per-configuration caches (validate._limits)
class PrefillPolicy:
    """Every planning rule as a value. Defaults follow tt-metal's measured choices.

    ``lane_size`` is the number of KV slots in one lane (one runtime; a
    lane group of N lanes holds N * ``lane_size`` slots): an explicit slot
    must lie in ``[0, lane_size)`` and slots are unique within a batch, so a
    batch holds at most ``lane_size`` rows. A call without explicit slots
    is split into sub-batches of at most ``lane_size`` rows
    (``sub_batches``), each planned with slots ``0..k-1``.
    """

    tile_size: int = attrs.field(default=32, validator=_positive_int)
    waves: tuple[int, ...] = attrs.field(default=(1, 2, 4, 8, 16, 32), validator=_waves)
    length_ladder: tuple[int, ...] = attrs.field(default=(128, 1024), validator=_ladder)
    max_chunk_length: int = attrs.field(default=2048, validator=_positive_int)
    chunk_quantum: int = attrs.field(default=2048, validator=_positive_int)
    batching_enabled: bool = attrs.field(default=True, validator=_bool)
    max_batch_size: int = attrs.field(default=32, validator=_positive_int)
    lane_size: int = attrs.field(default=32, validator=_positive_int)
    max_batched_tokens: int = attrs.field(default=128 * 1024, validator=_positive_int)
    pad_partial_waves: bool = attrs.field(default=True, validator=_bool)
    table_width_multiple: int = attrs.field(default=8, validator=_positive_int)
    device_top_k_cap: int = attrs.field(default=32, validator=_positive_int)
    max_logprobs: int = attrs.field(default=20, validator=_non_negative_int)
    allow_forced_argmax: bool = attrs.field(default=True, validator=_bool)
    static_last_token_tile: bool = attrs.field(default=False, validator=_bool)
    trace_lengths: tuple[int, ...] | None = attrs.field(default=None, validator=_optional_lengths)
    packed_steps: bool = attrs.field(default=False, validator=_bool)
    min_active_rows: int = attrs.field(default=2, validator=_positive_int)
    max_wave_length: int | None = attrs.field(default=None, validator=_optional_positive_int)
    max_sampled_wave: int | None = attrs.field(default=None, validator=_optional_positive_int)
    split_oversize_buckets: bool = attrs.field(default=True, validator=_bool)
    isolate_cached_buckets: bool = attrs.field(default=False, validator=_bool)
    batch_cached_rows: bool = attrs.field(default=False, validator=_bool)

    def __attrs_post_init__(self):
        if self.max_chunk_length % self.tile_size:
            raise _fail("max_chunk_length", self.max_chunk_length, f"must be a multiple of tile_size={self.tile_size}")
        if self.max_wave_length is not None and self.max_wave_length > self.max_chunk_length:
            rule = f"must be <= max_chunk_length={self.max_chunk_length} (a wave is one step)"
            raise _fail("max_wave_length", self.max_wave_length, rule)

    @classmethod
    def from_tt_transformers(
        cls,
        *,
        physical_batch_sizes: tuple[int, ...],
        minimum_active_rows: int,
        maximum_sequence_length: int,
        maximum_physical_batch: int | None = None,
        maximum_total_tokens: int = 128 * 1024,
        allow_cached_prefix: bool = False,
        sampling_requires_batched_output: bool = True,
        batched_output_available: bool = True,
        **overrides,
    ) -> PrefillPolicy:
        """The policy a tt-transformers ``BatchedPrefillPolicy`` with these fields describes.

        Field by field: ``physical_batch_sizes`` -> ``waves``,
        ``minimum_active_rows`` -> ``min_active_rows``,
        ``maximum_physical_batch`` (default: the largest physical size) ->
        ``max_batch_size``, ``maximum_sequence_length`` ->
        ``max_wave_length``, ``maximum_total_tokens`` ->
        ``max_batched_tokens`` (strict in both), ``allow_cached_prefix`` ->
        ``batch_cached_rows`` (and, when False, ``isolate_cached_buckets``:
        a cached row sends its bucket to singles, as there). Sampling that
        needs a batched output the runtime lacks
        (``sampling_requires_batched_output`` and not
        ``batched_output_available``) gives ``max_sampled_wave=1``: sampled
        rows run as singles. Buckets are never split there
        (``split_oversize_buckets=False``). Two deviations stay ours: a
        fully cached row re-runs its final block for its output (there it
        has none), and batched cached rows start at their own cached block
        (there they recompute and rewrite their cached prefix).
        ``overrides`` are any other fields (``max_chunk_length``, ``lane_size``, ...).

        The Galaxy brief: ``PrefillPolicy.from_tt_transformers(physical_batch_sizes=(32,),
        minimum_active_rows=16, maximum_sequence_length=2048)``.
        """
        sizes = tuple(physical_batch_sizes) if isinstance(physical_batch_sizes, (tuple, list)) else ()
        if not sizes or any(type(s) is not int or not 1 <= s <= 32 for s in sizes):
            rule = "must be a non-empty tuple of ints in [1, 32]"
            raise _fail("physical_batch_sizes", physical_batch_sizes, rule)
        for name, value in (
            ("allow_cached_prefix", allow_cached_prefix),
            ("sampling_requires_batched_output", sampling_requires_batched_output),
            ("batched_output_available", batched_output_available),
        ):
            if type(value) is not bool:
                raise _fail(name, value, "must be a bool")
        largest = sizes[-1] if maximum_physical_batch is None else maximum_physical_batch
        fields = dict(
            waves=sizes,
            min_active_rows=minimum_active_rows,
            max_batch_size=largest,
            max_wave_length=maximum_sequence_length,
            max_batched_tokens=maximum_total_tokens,
            batch_cached_rows=allow_cached_prefix,
            isolate_cached_buckets=not allow_cached_prefix,
            split_oversize_buckets=False,
            max_sampled_wave=1 if sampling_requires_batched_output and not batched_output_available else None,
        )
        fields.update(overrides)
        return cls(**fields)

    # -- geometry rules -------------------------------------------------
    @classmethod
    def fine_rungs(cls, block_size: int, *, max_chunk_length: int = 2048) -> PrefillPolicy:
        """Rungs at every multiple of ``block_size`` up to ``max_chunk_length``, then every quarter
        of the max chunk up to four max chunks (powers of two beyond), and waves split exactly.

        For backends where a padded position or a padding row is pure extra
        work and nothing is compiled per shape (torch on a CPU). tt-metal's
        ladder, the default, exists to bound compiled programs and traces on
        a device; eager on a CPU it would pad a 129-token prompt to 1024 and
        a 2049-token one to 4096 (here: 2560, run as two 1280-token chunks).
        """
        if type(max_chunk_length) is not int or max_chunk_length <= 0:
            raise _fail("max_chunk_length", max_chunk_length, "must be a positive int")
        if type(block_size) is not int or block_size <= 0 or max_chunk_length % (4 * block_size):
            rule = f"must be a positive int with 4 * block_size dividing max_chunk_length={max_chunk_length}"
            raise _fail("block_size", block_size, rule)
        quarter = max_chunk_length // 4
        ladder = tuple(range(block_size, max_chunk_length + 1, block_size)) + tuple(
            range(max_chunk_length + quarter, 4 * max_chunk_length + 1, quarter)
        )
        return cls(
            tile_size=math.gcd(block_size, 32),
            length_ladder=ladder,
            max_chunk_length=max_chunk_length,
            pad_partial_waves=False,
        )

    def padded_length(self, num_tokens: int) -> int:
        """Physical token count for a prompt of ``num_tokens`` tokens."""
        ladder = self.length_ladder
        index = bisect.bisect_left(ladder, num_tokens)
        if index < len(ladder):
            return ladder[index]
        floor = self.length_ladder[-1] if self.length_ladder else self.tile_size
        return 1 << (max(num_tokens, floor) - 1).bit_length()

    def chunk_length(self, padded_work: int, block_size: int) -> int:
        """Tokens per model-body step for ``padded_work`` (a rung) of chunked work."""
        limit = self.max_chunk_length
        if padded_work <= limit:
            return padded_work
        for unit in (self.chunk_quantum, block_size):
            for candidate in range(limit - limit % unit, 0, -unit):
                if padded_work % candidate == 0:
                    return candidate
        msg = f"no multiple of block_size={block_size} <= {limit} divides {padded_work}"
        raise AssertionError(msg)  # check_policy_fits_layout makes the block size divide both

    def is_regular(self, length: int, cached: int) -> bool:
        """Whether a row runs as one regular step (and may join a wave)."""
        return cached == 0 and self.padded_length(length) <= self.max_chunk_length

    def fully_cached_step(self, block_size: int) -> int:
        """Step length of a fully cached row's read-only re-run of its final block."""
        return min(self.padded_length(block_size), self.max_chunk_length)

    def wave_for(self, num_active: int) -> int:
        """Smallest supported wave holding ``num_active`` rows."""
        for wave in self.waves:
            if wave >= num_active:
                return wave
        msg = f"no supported wave holds {num_active} rows (largest is {self.waves[-1]})"
        raise AssertionError(msg)

    @property
    def wave_length_limit(self) -> int:
        """Longest padded step a wave may run: ``max_wave_length``, else the max chunk."""
        return self.max_chunk_length if self.max_wave_length is None else self.max_wave_length

    def max_wave_for(self, padded_length: int, *, sampled: bool = False) -> int:
        """Largest wave a bucket of ``padded_length`` may use (0 if none); ``sampled``: its rows sample."""
        if padded_length > self.wave_length_limit:
            return 0
        cap = min(self.max_batch_size, self.lane_size)
        if sampled and self.max_sampled_wave is not None:
            cap = min(cap, self.max_sampled_wave)
        best = 0
        for wave in self.waves:
            if wave <= cap and wave * padded_length < self.max_batched_tokens:
                best = wave
        return best

    def wave_groups(self, num_rows: int, max_wave: int) -> list[tuple[int, bool]]:
        """A bucket of ``num_rows`` rows as consecutive ``(rows, is_wave)`` groups, in order.

        A wave holds at least ``min_active_rows`` rows (and two); the rows
        of any smaller group run alone. A bucket larger than ``max_wave``
        splits into waves of ``max_wave`` rows first, unless
        ``split_oversize_buckets`` is False: then every row runs alone.
        """
        least = max(2, self.min_active_rows)
        if max_wave < 2 or num_rows < least or num_rows > max_wave and not self.split_oversize_buckets:
            return [(num_rows, False)]
        groups = []
        for first in range(0, num_rows, max_wave):
            groups += [(size, size >= least) for size in self.split_wave(min(max_wave, num_rows - first))]
        return groups

    def split_wave(self, num_rows: int) -> list[int]:
        """Sizes of the waves ``num_rows`` bucket rows (<= the largest usable wave) run as."""
        if self.pad_partial_waves or num_rows in self.waves:
            return [num_rows]
        sizes = []
        while num_rows:
            size = max(w for w in self.waves if w <= num_rows) if min(self.waves) <= num_rows else num_rows
            sizes.append(size)
            num_rows -= size
        return sizes

    def sub_batches(self, num_rows: int) -> tuple[range, ...]:
        """Consecutive row ranges of at most ``lane_size`` rows covering ``num_rows`` rows, in order."""
        size = self.lane_size
        return tuple(range(first, min(first + size, num_rows)) for first in range(0, num_rows, size))

    def table_width(self, num_blocks: int) -> int:
        """Page-table width holding ``num_blocks`` columns, rounded up."""
        return round_up(max(num_blocks, 1), self.table_width_multiple)

    def is_trace_eligible(self, invocation_length: int) -> bool:
        return self.trace_lengths is None or invocation_length in self.trace_lengths


def check_policy_fits_layout(policy: PrefillPolicy, layout: PageTableLayout) -> None:
    """Raises ``InvalidPolicyError`` when a chunk or padded length is not block aligned."""
    bs = layout.block_size
    for field in ("max_chunk_length", "chunk_quantum"):
        value = getattr(policy, field)
        if value % bs:
            raise _fail(field, value, f"must be a multiple of the block size {bs}")
    for rung in policy.length_ladder:
        if rung % bs:
            raise _fail("length_ladder", policy.length_ladder, f"rung {rung} is not a multiple of the block size {bs}")
    if not policy.length_ladder and policy.tile_size % bs:
        raise _fail("tile_size", policy.tile_size, f"with an empty ladder it must be a multiple of the block size {bs}")
