"""tt-transformers' batching policy on ``PrefillPolicy``: wave admission, the Galaxy brief, its rule as an oracle."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefill_core import (
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    RequestKind,
    SamplingParams,
    SamplingPath,
    manifest_for,
    prepare_prefill,
)
from prefill_core.planning.plan import plan_prefill
from prefill_core.values.errors import InvalidPolicyError
from tests.core.plan_checks import expected_writes, writes_by_source_row
from tests.strategies import cases
from tests.tt_transformers_rule import GALAXY, tt_transformers_cost

BS = 32
GALAXY_POLICY = PrefillPolicy.from_tt_transformers(
    physical_batch_sizes=(32,), minimum_active_rows=16, maximum_sequence_length=2048
)


def _batch(shapes, sampling=None) -> tuple[PrefillBatch, PageTableLayout]:
    """Rows ``(length, cached)`` on disjoint consecutive blocks, slots 0..n-1, all with ``sampling``."""
    rows, block = [], 0
    for slot, (length, cached) in enumerate(shapes):
        need = -(-length // BS)
        rows.append(PrefillRow(length, cached, slot, tuple(range(block, block + need)), sampling))
        block += need
    longest = max(length for length, _ in shapes)
    return PrefillBatch.from_rows(rows), PageTableLayout(BS, -(-longest // BS), max(block, 1))


def _waves(plan) -> list[int]:
    return sorted(r.active_batch_size for r in plan if r.padded_batch > 1)


def test_the_galaxy_policy_maps_every_field():
    """from_tt_transformers puts each tt-transformers field on the field with its meaning."""
    p = GALAXY_POLICY
    assert (p.waves, p.min_active_rows, p.max_batch_size, p.max_wave_length) == ((32,), 16, 32, 2048)
    assert (p.max_batched_tokens, p.batch_cached_rows, p.isolate_cached_buckets) == (128 * 1024, False, True)
    assert (p.split_oversize_buckets, p.max_sampled_wave) == (False, None)
    fallback = PrefillPolicy.from_tt_transformers(
        physical_batch_sizes=(1, 2, 4, 8),
        minimum_active_rows=2,
        maximum_sequence_length=1024,
        batched_output_available=False,
    )
    assert (fallback.max_sampled_wave, fallback.max_batch_size) == (1, 8)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(physical_batch_sizes=(), minimum_active_rows=2, maximum_sequence_length=128), "physical_batch_sizes"),
        (dict(physical_batch_sizes=(64,), minimum_active_rows=2, maximum_sequence_length=128), "physical_batch_sizes"),
        (dict(physical_batch_sizes=(3,), minimum_active_rows=2, maximum_sequence_length=128), "waves"),
        (dict(physical_batch_sizes=(32,), minimum_active_rows=0, maximum_sequence_length=128), "min_active_rows"),
        (dict(physical_batch_sizes=(32,), minimum_active_rows=2, maximum_sequence_length=4096), "max_wave_length"),
        (
            dict(physical_batch_sizes=(32,), minimum_active_rows=2, maximum_sequence_length=128, allow_cached_prefix=1),
            "allow_cached_prefix",
        ),
    ],
)
def test_a_bad_tt_transformers_field_is_named(fields, field):
    """A field the policy cannot take is an InvalidPolicyError naming our field (or theirs, where it has no twin)."""
    with pytest.raises(InvalidPolicyError, match=field):
        PrefillPolicy.from_tt_transformers(**fields)


def test_galaxy_runs_fifteen_rows_alone_and_sixteen_as_a_wave():
    """Under the Galaxy brief a bucket of 15 uncached rows runs as singles; 16 make one 32-row wave."""
    batch, layout = _batch([(100, 0)] * 15)
    assert _waves(plan_prefill(batch, GALAXY_POLICY, layout)) == []
    batch, layout = _batch([(100, 0)] * 16)
    (wave,) = plan_prefill(batch, GALAXY_POLICY, layout)
    assert (wave.active_batch_size, wave.padded_batch) == (16, 32)


def test_a_cached_row_sends_its_bucket_to_singles_when_cached_rows_may_not_batch():
    """isolate_cached_buckets: 20 rows of rung 128 and one cached row with 100 uncached tokens all run alone."""
    shapes = [(100, 0)] * 20 + [(356, 256)]
    batch, layout = _batch(shapes)
    assert _waves(plan_prefill(batch, GALAXY_POLICY, layout)) == []
    apart = attrs.evolve(GALAXY_POLICY, isolate_cached_buckets=False)
    assert _waves(plan_prefill(batch, apart, layout)) == [20]


def test_a_bucket_larger_than_its_wave_runs_alone_unless_splitting_is_allowed():
    """tt-transformers never splits a bucket: 40 rows with 32-row waves run alone; ours may split off a full wave."""
    batch, layout = _batch([(100, 0)] * 40)
    lane = attrs.evolve(GALAXY_POLICY, lane_size=64)
    assert _waves(plan_prefill(batch, lane, layout)) == []
    split = attrs.evolve(lane, split_oversize_buckets=True)
    assert _waves(plan_prefill(batch, split, layout)) == [32]  # the 8 left are fewer than 16: singles


def test_sampled_rows_fall_back_to_singles_without_a_batched_sampled_output():
    """max_sampled_wave=1: sampled rows run alone while logits rows of the same rung still batch."""
    policy = PrefillPolicy(max_sampled_wave=1)
    sampled, layout = _batch([(100, 0)] * 4, SamplingParams())
    assert _waves(plan_prefill(sampled, policy, layout)) == []
    logits, layout = _batch([(100, 0)] * 4)
    assert _waves(plan_prefill(logits, policy, layout)) == [4]


def test_a_wave_longer_than_max_wave_length_runs_alone():
    """max_wave_length (tt-transformers' maximum_sequence_length) bounds a wave's padded length."""
    batch, layout = _batch([(1000, 0)] * 4)
    assert _waves(plan_prefill(batch, PrefillPolicy(max_wave_length=128), layout)) == []
    assert _waves(plan_prefill(batch, PrefillPolicy(max_wave_length=1024), layout)) == [4]


@settings(max_examples=max(5, settings.default.max_examples // 4))
@given(cases(), st.integers(1, 40))
def test_a_wave_never_has_fewer_active_rows_than_the_minimum(case, minimum):
    """Every batched request holds at least min_active_rows real rows (and at least two)."""
    policy = attrs.evolve(case.policy, min_active_rows=minimum)
    for request in plan_prefill(case.batch, policy, case.layout):
        if request.kind is RequestKind.REGULAR_BATCHED:
            assert request.active_batch_size >= max(2, minimum)


def _row(length_class: int, length: int, cached_kind: int) -> tuple[int, int]:
    length = (length % 150 + 1, length % 1100 + 1, length % 9000 + 1)[length_class]
    aligned = length // BS * BS
    cached = (0, 0, 0, min(aligned, BS * (length % 7)), aligned)[cached_kind]
    return length, cached


_galaxy_rows = st.lists(
    st.builds(_row, st.integers(0, 2), st.integers(1, 10**6), st.integers(0, 4)), min_size=1, max_size=64
)


@given(_galaxy_rows, st.booleans())
def test_galaxy_never_computes_more_than_tt_transformers_rule(shapes, sampled):
    """Under the Galaxy brief a plan computes at most tt-transformers' positions on the same call,
    plus one final-block re-run per fully cached row (there it runs nothing and returns no output)."""
    policy = attrs.evolve(GALAXY_POLICY, lane_size=64)
    batch, layout = _batch(shapes, SamplingParams() if sampled else None)
    ours = sum(request.computed_tokens for request in plan_prefill(batch, policy, layout))
    lengths, cached = [n for n, _ in shapes], [c for _, c in shapes]
    theirs, _ = tt_transformers_cost(lengths, cached, GALAXY, lane=64)
    fully_cached = sum(n == c for n, c in shapes)
    assert ours <= theirs + fully_cached * policy.fully_cached_step(BS)


_POLICIES = {
    "galaxy": attrs.evolve(GALAXY_POLICY, lane_size=64),
    "sampled_singles": PrefillPolicy(max_sampled_wave=1, min_active_rows=3, max_wave_length=1024, lane_size=64),
    "cached_waves": PrefillPolicy(batch_cached_rows=True, lane_size=64),
}
"""Every policy holds the 64 rows ``_galaxy_rows`` may draw (the default lane of 32 would refuse row 32)."""
_LAYOUT = PageTableLayout(BS, 4096 // BS, 1 << 16)
_MANIFESTS = {name: manifest_for(policy, _LAYOUT) for name, policy in _POLICIES.items()}


@given(st.sampled_from(sorted(_POLICIES)), _galaxy_rows, st.booleans())
@example("cached_waves", [(2, 0)] * 33, False)
def test_the_manifest_covers_every_plan_under_the_new_fields(name, shapes, sampled):
    """Warming manifest_for leaves nothing to build for any plan of these policies."""
    shapes = [(min(n, 4096), min(c, n, 4096) // BS * BS) for n, c in shapes]
    batch, _ = _batch(shapes, SamplingParams(top_k=4) if sampled else None)
    for prepared in prepare_prefill(batch, _POLICIES[name], _LAYOUT):
        assert _MANIFESTS[name].covers(prepared)


def test_the_manifest_leaves_out_sampled_waves_wider_than_max_sampled_wave():
    """With max_sampled_wave=1 no batched program samples; batched logits programs remain."""
    programs = _MANIFESTS["sampled_singles"].program_signatures
    batched = [p for p in programs if p.padded_batch > 1]
    assert batched and all(p.sampling_path is SamplingPath.LOGITS for p in batched)


@settings(max_examples=max(5, settings.default.max_examples // 3))
@given(cases(), st.integers(1, 4))
def test_cached_rows_in_waves_write_exactly_what_they_write_alone(case, minimum):
    """With batch_cached_rows each row writes exactly the blocks from its cached offset's block on (no cached
    block), a chunked wave's rows share one start (their own computed start) and one step, and every row
    computes what it computes alone: the same step length from the same start."""
    policy = attrs.evolve(case.policy, batch_cached_rows=True, min_active_rows=minimum)
    plan = plan_prefill(case.batch, policy, case.layout)
    assert writes_by_source_row(plan) == expected_writes(case.batch, case.layout.block_size)
    alone = {
        r.source_rows[0]: r for r in plan_prefill(case.batch, attrs.evolve(policy, batching_enabled=False), case.layout)
    }
    for request in plan:
        if request.kind is RequestKind.CHUNKED and request.padded_batch > 1:
            assert request.num_chunks == 1 and request.active_batch_size >= max(2, minimum)
            for row in request.source_rows:
                single = alone[row]
                assert (single.first_chunk_start, single.chunk_length, single.num_chunks) == (
                    request.first_chunk_start,
                    request.chunk_length,
                    1,
                )


def test_a_request_whose_rows_are_out_of_caller_order_is_refused():
    """PrefillRequest refuses source_rows out of caller order: staging cuts consecutive rows as a slice, and a
    cached wave drafted as rows (0, 1, 3, 2) gave two rows each other's logits (3.7 off)."""
    batch, layout = _batch([(612, 512)] * 4)
    (wave,) = plan_prefill(batch, PrefillPolicy(batch_cached_rows=True), layout)
    with pytest.raises(ValueError, match="caller order"):
        attrs.evolve(wave, source_rows=(0, 1, 3, 2))
