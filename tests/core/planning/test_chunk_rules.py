"""Planner rules 2, 4, 5 and 6 (plan.py): no row computes more than tt-metal's rule, no step exceeds the max chunk.

Deterministic examples are the issue's "Done when" list; the properties
hold for every generated batch.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from prefill_core import SKIP, PageTableLayout, PrefillBatch, PrefillPolicy, PrefillRow, RequestKind, plan_prefill
from prefill_core.calls.manifest import length_buckets, reachable_chunks
from prefill_core.values.computed_positions import computed_start
from tests.strategies import cases

LAYOUT = PageTableLayout(block_size=32, max_num_blocks_per_seq=4096, num_blocks=200_000)


def rows_of(*specs, bs: int = 32) -> PrefillBatch:
    """Rows of ``(length, cached)`` with consecutive disjoint blocks and slots 0..n-1."""
    rows, block = [], 0
    for slot, (length, cached) in enumerate(specs):
        need = -(-length // bs)
        rows.append(PrefillRow(length, cached, slot, tuple(range(block, block + need))))
        block += need
    return PrefillBatch.from_rows(rows)


def steps(request) -> list[tuple[int, int]]:
    return [(chunk.start, chunk.length) for chunk in request.chunks]


# ---------------------------------------------------------------- the examples


def test_1091_cached_768_runs_one_1024_token_chunk_at_768():
    """The uncached 323 tokens pad to 1024 on the ladder: one 1024-token chunk at 768."""
    (request,) = plan_prefill(rows_of((1091, 768)), PrefillPolicy(), LAYOUT)
    assert steps(request) == [(768, 1024)]


def test_20000_cached_19968_runs_one_128_token_chunk_at_19968():
    """The uncached 32 tokens pad to 128: one 128-token chunk at 19968, not a 2048-token step."""
    (request,) = plan_prefill(rows_of((20000, 19968)), PrefillPolicy(), LAYOUT)
    assert steps(request) == [(19968, 128)]


def test_fully_cached_2048_reruns_one_128_token_step_writing_nothing():
    """A fully cached 2048-token row runs one 128-token step at 2016 (covering 2016-2143) that writes no KV."""
    (request,) = plan_prefill(rows_of((2048, 2048)), PrefillPolicy(), LAYOUT)
    assert steps(request) == [(2016, 128)]
    (fill,) = request.fill_table_of(request.final_chunk)
    assert set(fill) == {SKIP}


def test_5000_5000_4097_with_max_chunk_6144_never_steps_past_6144():
    """Rows whose rung (8192) exceeds the 6144 max chunk run chunked; 4097 runs two 4096-token chunks."""
    requests = plan_prefill(rows_of((5000, 0), (5000, 0), (4097, 0)), PrefillPolicy(max_chunk_length=6144), LAYOUT)
    assert all(chunk.length <= 6144 for request in requests for chunk in request.chunks)
    assert [steps(r) for r in requests] == [[(0, 4096), (4096, 4096)]] * 3


def test_32_rows_of_128_at_block_16_get_a_regular_table_of_width_8():
    """32 x 128 tokens at block size 16 form one wave whose regular table is 128/16 = 8 wide."""
    layout = PageTableLayout(block_size=16, max_num_blocks_per_seq=64, num_blocks=4096)
    (request,) = plan_prefill(rows_of(*[(128, 0)] * 32, bs=16), PrefillPolicy(), layout)
    assert request.kind is RequestKind.REGULAR_BATCHED and request.fill_table.width == 8


@pytest.mark.parametrize(
    ("length", "cached", "read_width"), [(1091, 768, 4128), (20000, 19968, 4104), (2048, 2048, 4104), (40, 32, 4104)]
)
def test_chunked_read_width_spans_the_layout_plus_one_chunk_overhang(length, cached, read_width):
    """Read width is the layout's, table_width(ceil((capacity + chunk - 1)/bs)): 4096+32 (chunk 1024), 4096+4 (128)."""
    (request,) = plan_prefill(rows_of((length, cached)), PrefillPolicy(), LAYOUT)
    assert request.read_table.width == read_width


# ---------------------------------------------------------------- properties


def _plan(case):
    return plan_prefill(case.batch, case.policy, case.layout)


@given(cases())
def test_no_step_is_longer_than_the_max_chunk(case):
    """Rule 4/2: every step of every request, regular or chunked, is <= max_chunk_length."""
    for request in _plan(case):
        assert request.chunk_length <= case.policy.max_chunk_length


@given(cases())
def test_chunked_rows_tile_their_work_and_stop_after_the_last_token(case):
    """Rule 4: a partly cached or long row's chunks tile [start, start + P) and stop after its last token.

    ``start`` is the start of the block holding the cached offset (``computed_positions``).
    """
    policy, bs = case.policy, case.layout.block_size
    for request in _plan(case):
        length, cached = request.lengths[0], request.cached[0]
        if not request.kind.is_chunked or cached == length:
            continue
        start = computed_start(length, cached, bs)
        work = policy.padded_length(length - start)
        chunks = request.chunks
        assert chunks[0].start == start and chunks[-1].start <= length - 1 < chunks[-1].end
        assert chunks[-1].end <= start + work  # computes at most P positions
        assert work % request.chunk_length == 0  # chunks tile the padded work exactly
        assert request.chunk_length == policy.chunk_length(work, bs)


@given(cases())
def test_regular_rows_compute_their_rung(case):
    """Rule 2: a regular request runs one step of rung(length) for each of its rows."""
    for request in _plan(case):
        if request.kind.is_chunked:
            continue
        assert request.num_chunks == 1
        assert all(case.policy.padded_length(n) == request.chunk_length for n in request.lengths)
        assert request.chunk_length <= case.policy.max_chunk_length


@given(cases())
def test_manifest_reachable_chunks_include_every_planned_chunk(case):
    """Every chunked request's chunk length is among those manifest_for enumerates for its length bucket."""
    policy, layout = case.policy, case.layout
    buckets = {padded: (lo, hi) for padded, lo, hi in length_buckets(policy, layout.capacity)}
    for request in _plan(case):
        if request.kind.is_chunked:
            lo, hi = buckets[request.padded_length]
            assert request.chunk_length in reachable_chunks(policy, layout.block_size, request.padded_length, lo, hi)
