"""Hypothesis strategies for the planning core.

* ``layouts``: page-table layouts with block sizes 16, 32 and 64.
* ``policies``: valid, generated policies (power-of-two waves, block-aligned
  ladders and chunk lengths, a lane large enough for the batch).
* ``case_specs`` / ``cases``: valid ``(batch, policy, layout)`` triples of
  1-80 rows, lengths 1..131072 biased towards boundary values, cached
  offsets anywhere (block-aligned ones and fully cached rows favoured),
  unique slots, disjoint written
  blocks, cached prefixes that may be shared between rows, junk stale tails
  after each mapped prefix and optional sampling parameters.
* ``invalid_cases``: a valid spec with exactly one rule broken, labelled with
  the ``PrefillInputError`` subclass, row and field the core must report.
* ``plugin_encodings``: per-row sampling encodings as vLLM's Tenstorrent
  plugin sends them, drawn from a few distinct ones so rows repeat.

Block ids are handed out arithmetically (no per-block draws), so examples
stay cheap even when a row maps thousands of blocks.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable

import attrs
from hypothesis import assume
from hypothesis import strategies as st

from prefill_core import (
    BlockConflictError,
    CapacityError,
    EmptyBatchError,
    InvalidCachedLengthError,
    InvalidLayoutError,
    InvalidLengthError,
    InvalidPageTableError,
    InvalidPolicyError,
    InvalidSamplingError,
    InvalidSlotError,
    PageTableLayout,
    PositionLimitError,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    RepeatedBlockError,
    SamplingParams,
    SharedBlockColumnError,
    prepare_prefill,
)
from prefill_core.tuning.histogram import HistogramEntry
from prefill_core.values.computed_positions import written_columns
from prefill_core.values.pooling import ClassifyActivation, PoolerConfig, PoolingParams, PoolingType

__all__ = [
    "BLOCK_SIZES",
    "MAX_ROWS",
    "MAX_LENGTH",
    "Case",
    "CaseSpec",
    "InvalidCase",
    "layouts",
    "policies",
    "sampling_params",
    "case_specs",
    "cases",
    "invalid_cases",
    "INVALID_RULES",
    "row_lengths",
    "fully_cached_cases",
    "garbled_specs",
    "JUNK",
    "histograms",
    "pooler_configs",
    "pooling_params",
    "chunk_runs",
]

BLOCK_SIZES = (16, 32, 64)
MAX_ROWS = 80
MAX_LENGTH = 131072
TILE = 32
MAX_TOTAL_BLOCKS = 12_000
"""Budget of mapped blocks per generated batch (keeps one example in the milliseconds)."""

EXPLICIT_ROWS = 8
"""Rows drawn one by one; the rest of a batch repeats their shapes."""

BOUNDARY_LENGTHS = (1, 128, 129, 1024, 1025, 2048, 2049, 4097, 131072)
WAVE_CHOICES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_WAVES = (1, 2, 4, 8, 16, 32)


# ---------------------------------------------------------------- values


@attrs.frozen
class Case:
    """A valid planning input."""

    batch: PrefillBatch
    policy: PrefillPolicy
    layout: PageTableLayout


@attrs.frozen
class CaseSpec:
    """The raw material of a case, before the validating constructors run.

    ``PrefillRow`` has no validators, so rows here may break any rule;
    ``PrefillBatch``, ``PrefillPolicy`` and ``PageTableLayout`` validate when
    ``build`` constructs them.
    """

    rows: tuple[PrefillRow, ...]
    policy_kwargs: dict = attrs.field(eq=False)
    layout_kwargs: dict = attrs.field(eq=False)

    def build(self) -> Case:
        return Case(
            PrefillBatch.from_rows(self.rows),
            PrefillPolicy(**self.policy_kwargs),
            PageTableLayout(**self.layout_kwargs),
        )

    @property
    def block_size(self) -> int:
        return self.layout_kwargs["block_size"]


@attrs.frozen
class InvalidCase:
    """A spec with exactly one broken rule and what the core must report for it.

    ``row`` is ``None`` for batch-, policy- and layout-level rules; ``value``
    is the offending value when the message must show its ``repr`` (``None``
    when the message shows a summary instead).
    """

    rule: str
    error: type
    row: int | None
    field: str
    value: object
    spec: CaseSpec
    max_position: int | None = None

    def run(self):
        """Builds the values and prepares them: the whole public path a caller takes."""
        case = self.spec.build()
        return prepare_prefill(case.batch, case.policy, case.layout, max_position=self.max_position)


# ---------------------------------------------------------------- layouts and policies


@st.composite
def layouts(draw, block_size: int | None = None, min_capacity: int = 1, min_num_blocks: int = 1) -> PageTableLayout:
    """A valid layout whose capacity is >= ``min_capacity`` tokens."""
    bs = block_size if block_size is not None else draw(st.sampled_from(BLOCK_SIZES))
    need = -(-min_capacity // bs)
    width = need + draw(st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 256), st.integers(0, 4096)))
    pool = max(min_num_blocks, 1) + draw(st.integers(0, 64))
    return PageTableLayout(bs, width, pool)


def _rung_unit(block_size: int) -> int:
    """Ladder rungs and chunk lengths must be multiples of both the tile and the block."""
    return math.lcm(block_size, TILE)


@st.composite
def policy_kwargs(draw, block_size: int, min_lane: int = 1) -> dict:
    """Keyword arguments of a valid ``PrefillPolicy`` that fits ``block_size``."""
    unit = _rung_unit(block_size)
    waves = draw(
        st.one_of(
            st.just(DEFAULT_WAVES),
            st.sets(st.sampled_from(WAVE_CHOICES), min_size=1).map(lambda s: tuple(sorted(s))),
        )
    )
    rungs = st.lists(st.integers(1, 64).map(lambda k: k * unit), max_size=3, unique=True).map(
        lambda xs: tuple(sorted(xs))
    )
    ladder = draw(st.one_of(st.just((128, 1024)), rungs))
    if not ladder and TILE % block_size:
        ladder = (unit,)  # an empty ladder pads to powers of two from the tile: not block aligned here
    max_chunk = draw(
        st.one_of(
            st.just(2048),
            st.sampled_from((512, 1024, 4096, 8192)),
            st.integers(1, 64).map(lambda k: k * unit),
        )
    )
    quantum = draw(st.one_of(st.just(2048), st.sampled_from((block_size, unit, 512, 1024)), st.just(max_chunk)))
    lane = draw(st.one_of(st.just(max(32, min_lane)), st.integers(min_lane, min_lane + 64)))
    max_logprobs = draw(st.one_of(st.just(20), st.integers(0, 32)))
    return dict(
        tile_size=TILE,
        waves=waves,
        length_ladder=ladder,
        max_chunk_length=max_chunk,
        chunk_quantum=quantum,
        batching_enabled=draw(st.sampled_from((True, True, True, False))),
        max_batch_size=draw(st.one_of(st.just(32), st.integers(1, 64))),
        lane_size=lane,
        max_batched_tokens=draw(st.one_of(st.just(128 * 1024), st.sampled_from((2048, 8192, 65536, 1 << 20)))),
        pad_partial_waves=draw(st.booleans()),
        table_width_multiple=draw(st.one_of(st.just(8), st.integers(1, 16))),
        device_top_k_cap=draw(st.one_of(st.just(32), st.integers(1, 64))),
        max_logprobs=max_logprobs,
        allow_forced_argmax=draw(st.booleans()),
        static_last_token_tile=draw(st.booleans()),
        trace_lengths=draw(
            st.one_of(
                st.none(),
                st.sets(st.sampled_from((64, 128, 256, 1024, 2048, 4096)), min_size=1).map(lambda s: tuple(sorted(s))),
            )
        ),
    )


def policies(block_size: int, min_lane: int = 1) -> st.SearchStrategy[PrefillPolicy]:
    """A valid policy for ``block_size`` whose lane holds ``min_lane`` slots."""
    return policy_kwargs(block_size, min_lane).map(lambda kwargs: PrefillPolicy(**kwargs))


EXTREME_TEMPERATURES = (5e-324, 1e-300, 1e-39, 1e-6, 9.999e-6, 1e-5, 1e300)
"""Valid but extreme temperatures: subnormal, below and at the greedy epsilon, huge."""
EXTREME_TOP_P = (5e-324, 1e-46, 1e-39, 1e-7)
"""Valid top-p values that underflow in bfloat16 or float32."""


@st.composite
def sampling_params(draw, max_logprobs: int = 20) -> SamplingParams:
    """Valid sampling parameters (greedy, device top-k, beyond-cap top-k and extreme floats all occur)."""
    temperature = draw(
        st.one_of(st.sampled_from((0.0, 0.7, 1.0)), st.sampled_from(EXTREME_TEMPERATURES), st.floats(0.0, 4.0))
    )
    top_k = draw(st.one_of(st.sampled_from((0, 1, 32, 33)), st.integers(0, 200)))
    top_p = draw(st.one_of(st.just(1.0), st.sampled_from(EXTREME_TOP_P), st.floats(0.0, 1.0, exclude_min=True)))
    seed = draw(st.one_of(st.none(), st.integers(0, 2**63 - 1)))
    num_logprobs = draw(st.integers(0, max_logprobs))
    return SamplingParams(temperature, top_k, top_p, seed, num_logprobs)


# ---------------------------------------------------------------- batches


@functools.cache
def row_lengths(block_size: int, max_length: int = MAX_LENGTH) -> st.SearchStrategy[int]:
    """Prompt lengths in ``1..max_length``, biased towards small and boundary values."""
    edges = BOUNDARY_LENGTHS + (block_size - 1, block_size, block_size + 1)
    boundaries = sorted({n for n in edges if 1 <= n <= max_length})
    return st.one_of(
        st.sampled_from(boundaries),
        st.integers(1, min(300, max_length)),
        st.integers(1, min(4096, max_length)),
        st.integers(1, max_length),
    )


CACHED_MODES = st.sampled_from(("none", "none", "full", "any", "unaligned"))


def _cached_offset(draw, length: int, block_size: int) -> int:
    """0, the whole block-aligned prefix (the full prompt when aligned), any aligned offset, or any offset."""
    whole = length // block_size
    mode = draw(CACHED_MODES)
    if mode == "unaligned":
        return draw(st.integers(0, length))
    if mode == "none" or not whole:
        return 0
    return block_size * (whole if mode == "full" else draw(st.integers(0, whole)))


def _arrange(ids: list[int], order: str, rnd) -> list[int]:
    if order == "reversed":
        return ids[::-1]
    if order == "shuffled":
        rnd.shuffle(ids)
    return ids


@st.composite
def case_specs(
    draw,
    *,
    min_rows: int = 1,
    max_rows: int = MAX_ROWS,
    block_sizes: tuple[int, ...] = BLOCK_SIZES,
    max_length: int = MAX_LENGTH,
) -> CaseSpec:
    """The raw material of a valid case (see the module docstring)."""
    bs = draw(st.sampled_from(block_sizes))
    n = draw(st.one_of(st.integers(min_rows, min(max_rows, min_rows + 3)), st.integers(min_rows, max_rows)))
    pkw = draw(policy_kwargs(bs, n))
    # Bulk details of large batches (tails, sharing, slot order, extra rows)
    # come from a seeded generator: per-row draws would dominate the run time.
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    mode = draw(st.sampled_from(("none", "all", "mixed")))
    params_of = sampling_params(pkw["max_logprobs"])

    # Up to EXPLICIT_ROWS rows are drawn one by one; further rows repeat one
    # of them (same length bucket: this is what fills waves).
    budget = MAX_TOTAL_BLOCKS
    shapes: list[tuple[int, int, SamplingParams | None]] = []
    for i in range(n):
        if i < EXPLICIT_ROWS:
            length = draw(row_lengths(bs, max_length))
            offset = _cached_offset(draw, length, bs)
            params = draw(params_of) if mode == "all" or (mode == "mixed" and draw(st.booleans())) else None
        else:
            length, offset, params = rnd.choice(shapes[:EXPLICIT_ROWS])
        if -(-length // bs) > budget:  # over the block budget: fold the row back in
            length = 1 + length % max(budget * bs, 1)
            offset = min(offset, length)
        budget -= -(-length // bs)
        shapes.append((length, offset, params))

    # Cached prefixes are either one shared prefix (rows reading the same
    # cached blocks) or the row's own blocks. Written blocks are all distinct.
    offsets = [c for _, c, _ in shapes]
    shared_len = max(c // bs for c in offsets)
    share = [bool(c // bs) and rnd.random() < 0.5 for c in offsets]
    own_cached = sum(c // bs for c, s in zip(offsets, share) if not s)
    written = sum(-(-length // bs) - c // bs for length, c, _ in shapes)
    order = draw(st.sampled_from(("contiguous", "reversed", "shuffled")))
    ids = _arrange(list(range(shared_len + own_cached + written)), order, rnd)
    shared, cursor = ids[:shared_len], shared_len
    num_blocks = len(ids) + draw(st.integers(0, 32))

    slots = list(range(n)) if draw(st.booleans()) else rnd.sample(range(pkw["lane_size"]), n)
    with_tails = draw(st.booleans())

    rows = []
    for i, (length, c, params) in enumerate(shapes):
        k, need = c // bs, -(-length // bs)
        if share[i]:
            prefix = shared[:k]
        else:
            prefix, cursor = ids[cursor : cursor + k], cursor + k
        own, cursor = ids[cursor : cursor + need - k], cursor + need - k
        tail = [rnd.randint(-1, num_blocks + 8) for _ in range(rnd.randint(0, 8))] if with_tails else []
        rows.append(PrefillRow(length, c, slots[i], tuple(prefix) + tuple(own) + tuple(tail), params))

    lengths = [length for length, _, _ in shapes]
    max_len = max(lengths)
    width = -(-max_len // bs) + draw(st.one_of(st.just(0), st.integers(0, 64)))
    return CaseSpec(tuple(rows), pkw, dict(block_size=bs, max_num_blocks_per_seq=width, num_blocks=num_blocks))


def cases(**kwargs) -> st.SearchStrategy[Case]:
    """Valid ``Case`` values; keyword arguments as for ``case_specs``."""
    return case_specs(**kwargs).map(CaseSpec.build)


# ---------------------------------------------------------------- invalid inputs


def _with_row(spec: CaseSpec, index: int, **changes) -> CaseSpec:
    rows = list(spec.rows)
    rows[index] = attrs.evolve(rows[index], **changes)
    return attrs.evolve(spec, rows=tuple(rows))


def _with_block(spec: CaseSpec, index: int, column: int, block: int) -> CaseSpec:
    blocks = list(spec.rows[index].blocks)
    blocks[column] = block
    return _with_row(spec, index, blocks=tuple(blocks))


def _written(row: PrefillRow, bs: int) -> range:
    return written_columns(row.length, row.cached, bs)


def _num_read(row: PrefillRow, bs: int) -> int:
    """How many leading columns the row reads as cached (every column before its first written one)."""
    written = _written(row, bs)
    return written.start if written else -(-row.length // bs)


def _breakers(spec: CaseSpec) -> dict[str, Callable]:
    """Every rule that can be broken in ``spec``, as ``name -> draw -> InvalidCase``."""
    bs = spec.block_size
    rows = spec.rows
    n = len(rows)
    pool = spec.layout_kwargs["num_blocks"]
    lane = spec.policy_kwargs["lane_size"]
    capacity = bs * spec.layout_kwargs["max_num_blocks_per_seq"]
    writers = [i for i, r in enumerate(rows) if len(_written(r, bs))]
    readers = [i for i, r in enumerate(rows) if _num_read(r, bs)]
    out: dict[str, Callable] = {}

    def any_row(draw):
        return draw(st.integers(0, n - 1))

    out["empty batch"] = lambda draw: InvalidCase(
        "empty batch", EmptyBatchError, None, "rows", (), attrs.evolve(spec, rows=())
    )

    def length(draw):
        i, value = any_row(draw), draw(st.integers(-(2**40), 0))
        return InvalidCase(
            "length <= 0", InvalidLengthError, i, "length", value, _with_row(spec, i, length=value, cached=0)
        )

    def cached_negative(draw):
        i, value = any_row(draw), draw(st.integers(-(2**20), -1).map(lambda v: v * bs))
        return InvalidCase("cached < 0", InvalidCachedLengthError, i, "cached", value, _with_row(spec, i, cached=value))

    def cached_beyond(draw):
        i = any_row(draw)
        value = (rows[i].length // bs + draw(st.integers(1, 4))) * bs
        return InvalidCase(
            "cached > length", InvalidCachedLengthError, i, "cached", value, _with_row(spec, i, cached=value)
        )

    def duplicate_slot(draw):
        i, j = sorted(draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True)))
        value = rows[i].slot
        return InvalidCase("duplicate slot", InvalidSlotError, j, "slot", value, _with_row(spec, j, slot=value))

    def slot_beyond_lane(draw):
        i, value = any_row(draw), lane + draw(st.integers(0, 1000))
        return InvalidCase("slot >= lane_size", InvalidSlotError, i, "slot", value, _with_row(spec, i, slot=value))

    def short_prefix(draw):
        i = any_row(draw)
        need = -(-rows[i].length // bs)
        keep = draw(st.integers(0, need - 1))
        changed = _with_row(spec, i, blocks=rows[i].blocks[:keep])
        return InvalidCase("mapped prefix too short", InvalidPageTableError, i, "blocks", None, changed)

    def bad_block(draw):
        i = any_row(draw)
        column = draw(st.integers(0, -(-rows[i].length // bs) - 1))
        value = draw(st.one_of(st.integers(-(2**40), -1), st.integers(pool, pool + 2**40)))
        return InvalidCase(
            "block outside the pool",
            InvalidPageTableError,
            i,
            f"blocks[{column}]",
            value,
            _with_block(spec, i, column, value),
        )

    def two_writers(draw):
        i, j = draw(st.lists(st.sampled_from(writers), min_size=2, max_size=2, unique=True))
        source = draw(st.sampled_from(_written(rows[i], bs)))
        target = draw(st.sampled_from(_written(rows[j], bs)))
        value = rows[i].blocks[source]
        later, column = (j, target) if j > i else (i, source)
        return InvalidCase(
            "block written by two rows",
            BlockConflictError,
            later,
            f"blocks[{column}]",
            value,
            _with_block(spec, j, target, value),
        )

    def written_twice(draw):
        i = draw(st.sampled_from([w for w in writers if len(_written(rows[w], bs)) >= 2]))
        first, second = sorted(
            draw(st.lists(st.sampled_from(_written(rows[i], bs)), min_size=2, max_size=2, unique=True))
        )
        value = rows[i].blocks[first]
        return InvalidCase(
            "row writes a block twice",
            BlockConflictError,
            i,
            f"blocks[{second}]",
            value,
            _with_block(spec, i, second, value),
        )

    def overwrite_targets() -> list[tuple[int, int, int, int]]:
        """``(reader, cached column, writer, written column)`` where the writer does not itself read that block
        and does not fill it whole at the reader's column (the one legal way to write a block another row reads)."""
        reads = {w: set(rows[w].blocks[: _num_read(rows[w], bs)]) for w in writers}
        found = []
        for i in readers:
            for column in sorted({0, _num_read(rows[i], bs) - 1}):
                block = rows[i].blocks[column]
                for w in writers:
                    if w == i or block in reads[w]:
                        continue
                    whole = rows[w].length >= (column + 1) * bs
                    found += [(i, column, w, t) for t in _written(rows[w], bs) if t != column or not whole]
        return found[:64]

    def overwrites_cached(draw):
        i, column, j, target = draw(st.sampled_from(overwrite_targets()))
        value = rows[i].blocks[column]
        changed = _with_block(spec, j, target, value)
        # Cached prefixes may be shared: the first row reading that block is reported.
        reader = next(k for k, r in enumerate(changed.rows) if value in r.blocks[: _num_read(r, bs)])
        column = changed.rows[reader].blocks.index(value)
        return InvalidCase(
            "written block is another row's cached block",
            BlockConflictError,
            reader,
            f"blocks[{column}]",
            value,
            changed,
        )

    def repeated_in_row(draw):
        i = draw(st.sampled_from([k for k, r in enumerate(rows) if r.cached >= 2 * bs]))
        first, second = sorted(
            draw(st.lists(st.integers(0, rows[i].cached // bs - 1), min_size=2, max_size=2, unique=True))
        )
        value = rows[i].blocks[first]
        changed = _with_block(spec, i, second, value)
        return InvalidCase("block repeated in a row", RepeatedBlockError, i, f"blocks[{second}]", value, changed)

    def shared_elsewhere(draw):
        i, c_i, k, c_k = draw(st.sampled_from(_shared_column_targets(rows, bs)))
        value = rows[i].blocks[c_i]
        changed = _with_block(spec, k, c_k, value)
        holders = [
            (r, row.blocks.index(value))
            for r, row in enumerate(changed.rows)
            if value in row.blocks[: _num_read(row, bs)]
        ]
        first_column = holders[0][1]
        row, column = next((r, c) for r, c in holders[1:] if c != first_column)
        return InvalidCase(
            "shared cached block at another column", SharedBlockColumnError, row, f"blocks[{column}]", value, changed
        )

    def beyond_max_position(draw):
        longest = max(r.length for r in rows)
        limit = draw(st.integers(1, longest - 1))
        i = next(k for k, r in enumerate(rows) if r.length > limit)
        return InvalidCase("length beyond max_position", PositionLimitError, i, "length", rows[i].length, spec, limit)

    def beyond_capacity(draw):
        i = any_row(draw)
        value = capacity + draw(st.integers(1, 4 * bs))
        return InvalidCase(
            "length beyond capacity", CapacityError, i, "length", value, _with_row(spec, i, length=value)
        )

    def policy_change(rule, field, value):
        kwargs = dict(spec.policy_kwargs, **{field: value})
        return InvalidCase(rule, InvalidPolicyError, None, field, value, attrs.evolve(spec, policy_kwargs=kwargs))

    def wave_not_power(draw):
        bad = draw(st.integers(3, 1000).filter(lambda w: w & (w - 1)))
        return policy_change(
            "wave not a power of two", "waves", tuple(sorted(set(spec.policy_kwargs["waves"]) | {bad}))
        )

    def ladder_not_increasing(draw):
        unit = _rung_unit(bs)
        a = draw(st.integers(1, 64)) * unit
        b = draw(st.integers(1, a // unit)) * unit
        return policy_change("ladder not increasing", "length_ladder", (a, b))

    def chunk_unaligned(draw):
        value = draw(st.integers(1, 256).map(lambda k: k * TILE).filter(lambda v: v % bs))
        return policy_change("max chunk not a multiple of the block size", "max_chunk_length", value)

    def sampling_change(draw):
        i = any_row(draw)
        max_logprobs = spec.policy_kwargs["max_logprobs"]
        field, value = draw(
            st.one_of(
                st.tuples(st.just("temperature"), st.sampled_from((math.nan, math.inf, -math.inf, -0.5, -1))),
                st.tuples(st.just("top_k"), st.integers(-1000, -1)),
                st.tuples(st.just("top_p"), st.sampled_from((0.0, -0.1, 1.5, math.nan, 2))),
                st.tuples(st.just("num_logprobs"), st.integers(max_logprobs + 1, max_logprobs + 100)),
                st.tuples(st.just("seed"), st.sampled_from((-1, 2**63))),
            )
        )
        base = rows[i].sampling or SamplingParams()
        changed = _with_row(spec, i, sampling=attrs.evolve(base, **{field: value}))
        return InvalidCase(f"invalid sampling.{field}", InvalidSamplingError, i, f"sampling.{field}", value, changed)

    def block_size_not_power(draw):
        value = draw(st.integers(3, 200).filter(lambda v: v & (v - 1)))
        kwargs = dict(spec.layout_kwargs, block_size=value)
        return InvalidCase(
            "block size not a power of two",
            InvalidLayoutError,
            None,
            "block_size",
            value,
            attrs.evolve(spec, layout_kwargs=kwargs),
        )

    out.update(
        {
            "length <= 0": length,
            "cached < 0": cached_negative,
            "cached > length": cached_beyond,
            "slot >= lane_size": slot_beyond_lane,
            "mapped prefix too short": short_prefix,
            "block outside the pool": bad_block,
            "length beyond capacity": beyond_capacity,
            "wave not a power of two": wave_not_power,
            "ladder not increasing": ladder_not_increasing,
            "invalid sampling": sampling_change,
            "block size not a power of two": block_size_not_power,
        }
    )
    if n >= 2:
        out["duplicate slot"] = duplicate_slot
    if len(writers) >= 2:
        out["block written by two rows"] = two_writers
    if any(len(_written(rows[w], bs)) >= 2 for w in writers):
        out["row writes a block twice"] = written_twice
    if readers and writers and overwrite_targets():
        out["written block is another row's cached block"] = overwrites_cached
    if bs > TILE:
        out["max chunk not a multiple of the block size"] = chunk_unaligned
    if any(r.cached >= 2 * bs for r in rows):
        out["block repeated in a row"] = repeated_in_row
    if _shared_column_targets(rows, bs):
        out["shared cached block at another column"] = shared_elsewhere
    if any(r.length > 1 for r in rows):
        out["length beyond max_position"] = beyond_max_position
    return out


def _shared_column_targets(rows: tuple[PrefillRow, ...], bs: int) -> list[tuple[int, int, int, int]]:
    """``(i, column in i, k, column in k)``: copying row i's cached block into row k's other cached column
    makes a block shared at two columns (and nothing else: k does not already map it)."""
    found = []
    for i, a in enumerate(rows):
        for k, b in enumerate(rows):
            if i == k or not _num_read(a, bs) or not _num_read(b, bs):
                continue
            for c_i in sorted({0, _num_read(a, bs) - 1}):
                for c_k in sorted({0, _num_read(b, bs) - 1} - {c_i}):
                    if a.blocks[c_i] not in b.blocks[: -(-b.length // bs)]:
                        found.append((i, c_i, k, c_k))
    return found[:16]


INVALID_RULES = (
    "empty batch",
    "length <= 0",
    "cached < 0",
    "cached > length",
    "duplicate slot",
    "slot >= lane_size",
    "mapped prefix too short",
    "block outside the pool",
    "block written by two rows",
    "row writes a block twice",
    "written block is another row's cached block",
    "length beyond capacity",
    "length beyond max_position",
    "block repeated in a row",
    "shared cached block at another column",
    "wave not a power of two",
    "ladder not increasing",
    "max chunk not a multiple of the block size",
    "invalid sampling",
    "block size not a power of two",
)
"""Every rule ``invalid_cases`` knows how to break (``rule=`` takes one of these)."""


@st.composite
def invalid_cases(draw, rule: str | None = None, **spec_kwargs) -> InvalidCase:
    """A valid spec with one rule broken (``rule`` picks it; otherwise any that applies)."""
    if rule is not None and rule not in INVALID_RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {INVALID_RULES}")
    spec = draw(case_specs(**spec_kwargs))
    breakers = _breakers(spec)
    assert set(breakers) <= set(INVALID_RULES), sorted(set(breakers) - set(INVALID_RULES))
    if rule is not None:
        assume(rule in breakers)
        name = rule
    else:
        name = draw(st.sampled_from(sorted(breakers)))
    return breakers[name](draw)


def _fully_cache(spec: CaseSpec, index: int) -> CaseSpec:
    """``spec`` with row ``index`` turned into a fully cached prompt.

    The length rounds up to its last block (same mapped prefix, still within
    capacity) and every mapped block becomes cached: blocks that were only
    written by this row are now only read, so the batch stays valid.
    """
    bs = spec.block_size
    row = spec.rows[index]
    length = -(-row.length // bs) * bs
    return _with_row(spec, index, length=length, cached=length)


@st.composite
def fully_cached_cases(draw, **spec_kwargs) -> tuple[Case, int]:
    """A valid case in which at least one row (the returned index) is fully cached."""
    spec = draw(case_specs(**spec_kwargs))
    index = draw(st.integers(0, len(spec.rows) - 1))
    return _fully_cache(spec, index).build(), index


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.just(10**400),  # an int no float holds
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-2, 5), max_size=3),
    st.lists(st.integers(-2, 5), max_size=3).map(tuple),
    st.just(()),
)
"""Values of the wrong type or far outside any domain."""

ROW_FIELDS = ("length", "cached", "slot", "blocks", "sampling")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "num_logprobs")


@st.composite
def garbled_specs(draw) -> tuple[str, CaseSpec | tuple]:
    """A valid spec with one field replaced by junk: ``(what was garbled, spec)``.

    Junk may happen to be valid (then the batch must plan); ``"argument"``
    garbles a whole argument of ``prepare_prefill`` and returns the raw
    ``(batch, policy, layout)`` triple instead of a spec.
    """
    spec = draw(case_specs(max_rows=6))
    junk = draw(JUNK)
    where = draw(st.sampled_from(("row", "block", "sampling", "policy", "layout", "rows", "argument")))
    i = draw(st.integers(0, len(spec.rows) - 1))
    if where == "row":
        field = draw(st.sampled_from(ROW_FIELDS))
        return f"row {i}.{field}={junk!r}", _with_row(spec, i, **{field: junk})
    if where == "block":
        column = draw(st.integers(0, len(spec.rows[i].blocks) - 1))
        return f"row {i}.blocks[{column}]={junk!r}", _with_block(spec, i, column, junk)
    if where == "sampling":
        field = draw(st.sampled_from(SAMPLING_FIELDS))
        params = attrs.evolve(spec.rows[i].sampling or SamplingParams(), **{field: junk})
        return f"row {i}.sampling.{field}={junk!r}", _with_row(spec, i, sampling=params)
    if where == "policy":
        field = draw(st.sampled_from(sorted(spec.policy_kwargs)))
        return f"policy.{field}={junk!r}", attrs.evolve(spec, policy_kwargs=dict(spec.policy_kwargs, **{field: junk}))
    if where == "layout":
        field = draw(st.sampled_from(sorted(spec.layout_kwargs)))
        return f"layout.{field}={junk!r}", attrs.evolve(spec, layout_kwargs=dict(spec.layout_kwargs, **{field: junk}))
    if where == "rows":
        return f"rows={junk!r}", attrs.evolve(spec, rows=junk)
    case = spec.build()
    args = [case.batch, case.policy, case.layout]
    args[draw(st.integers(0, 2))] = junk
    return f"argument={junk!r}", tuple(args)


# ---------------------------------------------------------------- shell input forms and extreme sampling
# Generators for the classes issue 15 found getting through: ragged token
# lists, list page tables, extreme sampling floats and adversarial logits.

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_JUNK_INTS = st.one_of(st.integers(-2, 300), st.integers(INT64_MIN, INT64_MAX))
"""Values past a row's prompt or mapped prefix: never read, so any int64 is allowed there."""


@st.composite
def token_lists(draw, lengths: list[int], vocab: int, short_row: int | None = None) -> list[list[int]]:
    """Prompts as ragged Python lists: each row holds its prompt, then up to 8 junk ints.

    With ``short_row`` that row holds fewer tokens than its prompt length
    (possibly none), the class that was once zero-padded silently.
    """
    rows = []
    for row, length in enumerate(lengths):
        prompt = draw(st.lists(st.integers(1, vocab - 1), min_size=length, max_size=length))
        if row == short_row:
            rows.append(prompt[: draw(st.integers(0, length - 1))])
        else:
            rows.append(prompt + draw(st.lists(_JUNK_INTS, max_size=8)))
    return rows


@st.composite
def list_page_tables(draw, blocks: list[list[int]], short_row: int | None = None) -> list[list[int]]:
    """A page table as ragged Python lists: each row's mapped blocks, then up to 4 stale entries.

    With ``short_row`` that row stops before the end of its mapped prefix.
    """
    rows = []
    for row, mapped in enumerate(blocks):
        if row == short_row:
            rows.append(list(mapped[: draw(st.integers(0, len(mapped) - 1))]))
        else:
            rows.append(list(mapped) + draw(st.lists(_JUNK_INTS, max_size=4)))
    return rows


EXTREME_SAMPLING_TEMPERATURES = (0.0, 5e-324, 1e-300, 1e-39, 1e-6, 1e-5, 1.0, 1e300, 1.7976931348623157e308)
"""Accepted temperatures at the edges of float64: subnormal, around the greedy epsilon, the largest float."""
EXTREME_SAMPLING_TOP_P = (5e-324, 1e-300, 1e-46, 1e-7, 0.5, 1.0 - 2**-53, 1.0)
"""Accepted top-p values that underflow float32 or bfloat16, and the float just below 1."""
EXTREME_SAMPLING_TOP_K = (0, 1, 2, 20, 32, 33, 10**9, 2**62)


@st.composite
def extreme_sampling_params(draw, max_logprobs: int = 5) -> SamplingParams:
    """Accepted sampling parameters biased to extreme floats and top-k values (greedy rows included)."""
    temperature = draw(
        st.one_of(
            st.sampled_from(EXTREME_SAMPLING_TEMPERATURES),
            st.floats(0.0, 1e308, allow_nan=False, allow_infinity=False, allow_subnormal=True),
        )
    )
    top_k = draw(st.one_of(st.sampled_from(EXTREME_SAMPLING_TOP_K), st.integers(0, 300)))
    top_p = draw(
        st.one_of(
            st.sampled_from(EXTREME_SAMPLING_TOP_P),
            st.floats(0.0, 1.0, exclude_min=True, allow_nan=False, allow_subnormal=True),
        )
    )
    seed = draw(st.integers(0, INT64_MAX))
    return SamplingParams(temperature, top_k, top_p, seed, draw(st.integers(0, max_logprobs)))


@st.composite
def adversarial_logits(draw, vocab: int) -> list[float]:
    """float32-representable logits with ties, ``-inf`` entries and huge magnitudes (at least one finite).

    Magnitudes stay within 2**123 (about 1e37) so that differences of two logits stay finite in float32.
    """
    finite = st.floats(-(2.0**123), 2.0**123, allow_nan=False, allow_infinity=False, width=32)
    pool = draw(st.lists(finite, min_size=1, max_size=6)) + [0.0, float("-inf")]
    values = draw(st.lists(st.sampled_from(pool), min_size=vocab, max_size=vocab))
    values[draw(st.integers(0, vocab - 1))] = pool[0]  # at least one finite logit
    return values


# ---------------------------------------------------------------- ladder tuner histograms


@st.composite
def histograms(draw, block_size: int, max_length: int = 6000, max_entries: int = 10) -> tuple:
    """Tuner workloads: 1..``max_entries`` histogram entries of lengths 1..``max_length``, counts 1..5,
    cached offsets of every kind (none, block-aligned, the whole aligned prompt)."""
    entries = []
    for _ in range(draw(st.integers(1, max_entries))):
        length = draw(row_lengths(block_size, max_length))
        entries.append(HistogramEntry(length, draw(st.integers(1, 5)), _cached_offset(draw, length, block_size)))
    return tuple(entries)


@st.composite
def lane_calls(draw, max_lanes: int = 4, max_per_lane: int = 16) -> tuple[int, int, int, tuple[int, ...] | None]:
    """``(num_lanes, per_lane_batch, num_rows, slots)``: a valid call on a lane group, slots unique or None."""
    num_lanes = draw(st.integers(1, max_lanes), label="num_lanes")
    per_lane = draw(st.integers(1, max_per_lane), label="per_lane_batch")
    capacity = num_lanes * per_lane
    if draw(st.booleans(), label="without slots"):
        return num_lanes, per_lane, draw(st.integers(1, capacity), label="rows"), None
    slots = draw(st.lists(st.integers(0, capacity - 1), min_size=1, max_size=capacity, unique=True), label="slots")
    return num_lanes, per_lane, len(slots), tuple(slots)


@st.composite
def lane_group_rows(draw, num_lanes: int, per_lane: int, block_size: int = 16, max_length: int = 96):
    """``(rows, slots)`` for a lane group call: rows ``(length, cached, sampling)``, unique slots or None.

    Cached prefixes are block aligned (fully cached rows included); sampling
    covers logits, greedy with log-probs, device top-k and host-sampled rows,
    each sampled row with its own seed.
    """
    capacity = num_lanes * per_lane
    num_rows = draw(st.integers(1, capacity), label="rows")
    rows = []
    for _ in range(num_rows):
        length = draw(st.integers(1, max_length))
        cached = block_size * draw(st.integers(0, length // block_size)) if draw(st.booleans()) else 0
        kind = draw(st.sampled_from(("logits", "greedy", "topk", "host")))
        seed = draw(st.integers(0, 2**31))
        sampling = {
            "logits": None,
            "greedy": SamplingParams.greedy(num_logprobs=2),
            "topk": SamplingParams(top_k=3, temperature=0.9, seed=seed, num_logprobs=1),
            "host": SamplingParams(top_k=0, temperature=0.8, seed=seed),
        }[kind]
        rows.append((length, cached, sampling))
    if draw(st.booleans(), label="without slots"):
        return rows, None
    return rows, tuple(draw(st.permutations(range(capacity)))[:num_rows])


# ---------------------------------------------------------------- rows reading blocks other rows of the call write


@st.composite
def same_step_prefix_specs(draw) -> CaseSpec:
    """A valid spec in which rows read as cached whole blocks that other rows of the same call write.

    vLLM's prefix cache registers a full block when it allocates it, before
    the step that fills it: a later request of that step may map it as
    cached. Each reader takes a source row (any earlier row, so chains
    occur), maps the source's first ``m`` blocks, of which at least the last
    is one the source writes whole, and caches up to somewhere inside its own
    block ``m``; rows are then shuffled.
    """
    bs = draw(st.sampled_from(BLOCK_SIZES))
    num_rows = draw(st.integers(2, 8))
    next_id = 0
    rows: list[PrefillRow] = []
    for index in range(num_rows):
        sources = [r for r in rows if r.length // bs > _first_written_column(r, bs)]
        if index and sources and draw(st.booleans()):
            source = draw(st.sampled_from(sources))
            m = draw(st.integers(_first_written_column(source, bs) + 1, source.length // bs))
            cached = m * bs + draw(st.integers(0, bs - 1))
            length = draw(st.integers(cached + 1, cached + 12 * bs))
            prefix = source.blocks[:m]
        else:
            length = draw(st.integers(1, 20 * bs))
            cached = draw(st.one_of(st.just(0), st.integers(0, length - 1)))
            prefix = ()
        need = -(-length // bs)
        own = tuple(range(next_id, next_id + need - len(prefix)))
        next_id += len(own)
        rows.append(PrefillRow(length, cached, index, prefix + own))
    order = draw(st.permutations(range(num_rows)))
    rows = [attrs.evolve(rows[i], slot=slot) for slot, i in enumerate(order)]
    width = max(-(-r.length // bs) for r in rows) + draw(st.integers(0, 8))
    pkw = draw(policy_kwargs(bs, num_rows))
    return CaseSpec(tuple(rows), pkw, dict(block_size=bs, max_num_blocks_per_seq=width, num_blocks=next_id + 1))


def _first_written_column(row: PrefillRow, bs: int) -> int:
    written = written_columns(row.length, row.cached, bs)
    return written.start if written else -(-row.length // bs)


# ---------------------------------------------------------------- serving plugin

PLUGIN_FIELD_VALUES = {
    "temperature": (0.0, 0.7),
    "top_k": (1, 0, -1, 5, 4096),
    "top_p": (0.0, 0.9, 1.0),
    "presence_penalty": (0.0, 0.5),
    "frequency_penalty": (0.0, -0.25),
    "repetition_penalty": (1.0, 1.3),
    "seed": (-1, 7),
    "num_logprobs": (-2, 0),
}
"""Valid values of the plugin's per-row sampling fields, in its encodings (few each, so rows repeat)."""


@st.composite
def plugin_encodings(draw, max_rows: int = 12) -> list[dict]:
    """Per-row plugin encodings (field -> value) of 1..max_rows rows, drawn from a few distinct ones."""
    distinct = draw(
        st.lists(
            st.fixed_dictionaries({name: st.sampled_from(values) for name, values in PLUGIN_FIELD_VALUES.items()}),
            min_size=1,
            max_size=4,
        )
    )
    return draw(st.lists(st.sampled_from(distinct), min_size=1, max_size=max_rows))


# ---------------------------------------------------------------- pooling (prefill_core.values.pooling)


@st.composite
def pooler_configs(draw, max_hidden: int = 4096) -> PoolerConfig:
    """A model's valid pooler: any pooling type, with or without a head and Matryoshka support."""
    hidden = draw(st.integers(1, max_hidden))
    matryoshka = draw(st.booleans())
    dims = None
    if matryoshka and draw(st.booleans()):
        dims = tuple(sorted(draw(st.sets(st.integers(1, hidden), min_size=1, max_size=4))))
    labels = draw(st.none() | st.integers(1, 8))
    activation = None if labels is None else draw(st.sampled_from(list(ClassifyActivation)))
    return PoolerConfig(
        hidden_size=hidden,
        pooling_type=draw(st.sampled_from(list(PoolingType))),
        normalize=draw(st.booleans()),
        dimensions=draw(st.none() | st.integers(1, hidden)),
        matryoshka=matryoshka,
        matryoshka_dimensions=dims,
        num_labels=labels,
        activation=activation,
    )


@st.composite
def pooling_params(draw, config: PoolerConfig | None = None) -> PoolingParams:
    """A row request valid for ``config`` (any model's valid request when None: embed, no dimensions)."""
    tasks = ["embed"] if config is None or config.num_labels is None else ["embed", "classify"]
    if draw(st.sampled_from(tasks)) == "classify":
        return PoolingParams.classify(use_activation=draw(st.none() | st.booleans()))
    dims = None
    if config is not None and config.matryoshka and draw(st.booleans()):
        choices = config.matryoshka_dimensions or range(1, config.hidden_size + 1)
        dims = draw(st.sampled_from(list(choices)))
    return PoolingParams.embed(dimensions=dims, normalize=draw(st.none() | st.booleans()))


@st.composite
def chunk_runs(draw, max_length: int = 5000) -> tuple[int, int, list[tuple[int, int]]]:
    """``(length, cached, runs)``: a row's computed ``(start, length)`` runs from ``cached`` to its end.

    The runs are chunk boundaries anywhere (block-aligned or not); a padded
    wave's recomputed tail of a fully cached row shows as ``cached`` = length
    with one run over the last positions.
    """
    length = draw(st.integers(1, max_length))
    cached = draw(st.sampled_from([0, 0, draw(st.integers(0, length))]))
    start = min(cached, length - 1) if cached == length else cached
    cuts = sorted(draw(st.sets(st.integers(start + 1, length - 1), max_size=6))) if length - start > 1 else []
    bounds = [start, *cuts, length]
    return length, cached, [(a, b - a) for a, b in zip(bounds, bounds[1:])]
