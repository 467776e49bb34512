"""The warm-up manifest: complete for every plan, serializable, and ``observe`` adds exactly what was used."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import (
    InvalidPolicyError,
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    RequestKind,
    SamplingPath,
    WarmupManifest,
    manifest_for,
    prepare_prefill,
)
from tests.strategies import case_specs, cases, layouts, policies


def _prepare(case):
    return prepare_prefill(case.batch, case.policy, case.layout)


@given(cases())
def test_manifest_covers_every_prepared_request(case):
    """Every prepared request's program and trace signature is in manifest_for(policy, layout)."""
    manifest = manifest_for(case.policy, case.layout)
    programs, traces = set(manifest.program_signatures), set(manifest.trace_signatures)
    for prepared in _prepare(case):
        assert prepared.program_signature in programs
        assert prepared.trace_signature is None or prepared.trace_signature in traces
        assert manifest.covers(prepared)


@given(cases(), st.data())
def test_manifest_covers_plans_at_the_layouts_full_capacity(case, data):
    """A single row as long as the layout's capacity (cached or not) is covered too."""
    layout = case.layout
    length = layout.capacity - data.draw(st.integers(0, layout.block_size - 1))
    cached = data.draw(st.integers(0, length // layout.block_size)) * layout.block_size
    blocks = tuple(range(layout.blocks_for(length)))
    layout = attrs.evolve(layout, num_blocks=max(layout.num_blocks, len(blocks)))
    batch = PrefillBatch.from_rows(
        (attrs.evolve(case.batch.rows[0], length=length, cached=cached, slot=0, blocks=blocks),)
    )
    manifest = manifest_for(case.policy, layout)
    assert all(manifest.covers(p) for p in prepare_prefill(batch, case.policy, layout))


@given(cases())
def test_manifest_is_sorted_by_key_without_duplicates(case):
    """A manifest lists each signature once, ordered by key."""
    manifest = manifest_for(case.policy, case.layout)
    for signatures in (manifest.program_signatures, manifest.trace_signatures):
        keys = [s.key for s in signatures]
        assert keys == sorted(set(keys))


@given(cases())
def test_manifest_traces_are_the_trace_eligible_program_bodies(case):
    """The manifest's traces are exactly the bodies of its programs whose length the policy traces."""
    manifest = manifest_for(case.policy, case.layout)
    bodies = {p.body for p in manifest.program_signatures if case.policy.is_trace_eligible(p.invocation_length)}
    assert set(manifest.trace_signatures) == bodies


def test_default_manifest_for_8192_tokens_lists_21_bodies_and_126_programs():
    """The default policy over an 8192-token layout (block 32) warms 21 bodies as 126 programs.

    Chunked bodies: one per chunk length (128, 1024, 2048), each at the
    layout's read width ceil((8192 + chunk - 1) / 32) rounded up to 8,
    whichever length bucket and cached offset reaches it.
    """
    manifest = manifest_for(PrefillPolicy(), PageTableLayout(32, 256, 1024))
    kinds = [t.variant for t in manifest.trace_signatures]
    assert (len(manifest.trace_signatures), len(manifest.program_signatures)) == (21, 126)
    assert (
        kinds.count(RequestKind.REGULAR_SINGLE),
        kinds.count(RequestKind.REGULAR_BATCHED),
        kinds.count(RequestKind.CHUNKED),
    ) == (3, 15, 3)
    chunked = sorted(
        (t.chunk_length, t.read_table_width) for t in manifest.trace_signatures if t.variant is RequestKind.CHUNKED
    )
    assert chunked == [(128, 264), (1024, 288), (2048, 320)]


def test_manifest_restricted_to_sampling_paths_lists_only_those():
    """manifest_for with only the logits path lists logits programs and every body."""
    layout = PageTableLayout(32, 256, 1024)
    full = manifest_for(PrefillPolicy(), layout)
    logits = manifest_for(PrefillPolicy(), layout, [SamplingPath.LOGITS])
    assert {p.sampling_path for p in logits.program_signatures} == {SamplingPath.LOGITS}
    assert logits.trace_signatures == full.trace_signatures
    assert set(logits.program_signatures) < set(full.program_signatures)


def test_manifest_for_rejects_a_policy_that_does_not_fit_the_layout():
    """A max chunk that is not a multiple of the block size is an InvalidPolicyError."""
    with pytest.raises(InvalidPolicyError):
        manifest_for(PrefillPolicy(max_chunk_length=2080), PageTableLayout(64, 64, 64))


# ---------------------------------------------------------------- serialization


@given(st.data())
def test_manifest_json_round_trip_is_equal(data):
    """WarmupManifest.from_json(to_json()) gives an equal manifest with the same keys."""
    layout = data.draw(layouts())
    manifest = manifest_for(data.draw(policies(layout.block_size)), layout)
    back = WarmupManifest.from_json(manifest.to_json())
    assert back == manifest
    assert [s.key for s in back.program_signatures] == [s.key for s in manifest.program_signatures]


def test_manifest_saved_to_a_file_loads_back_equal(tmp_path):
    """A manifest written to disk as JSON and read back is equal to the original."""
    manifest = manifest_for(PrefillPolicy(static_last_token_tile=True), PageTableLayout(32, 512, 1024))
    path = tmp_path / "warmup.json"
    path.write_text(manifest.to_json())
    assert WarmupManifest.from_json(path.read_text()) == manifest


# ---------------------------------------------------------------- observe and covers


@given(cases())
def test_observe_adds_exactly_the_identities_used(case):
    """Observing prepared requests on an empty manifest yields exactly their programs and traces."""
    prepared = _prepare(case)
    observed = WarmupManifest().observe(prepared)
    assert set(observed.program_signatures) == {p.program_signature for p in prepared}
    assert set(observed.trace_signatures) == {p.trace_signature for p in prepared if p.trace_signature is not None}
    assert all(observed.covers(p) for p in prepared)


@given(case_specs(), case_specs())
def test_observe_is_a_union_and_idempotent(first, second):
    """Observing a second workload keeps everything already listed, adds its identities, and repeats add nothing."""
    a, b = first.build(), second.build()
    used_a, used_b = _prepare(a), _prepare(b)
    base = WarmupManifest().observe(used_a)
    both = base.observe(used_b)
    assert set(both.program_signatures) == set(base.program_signatures) | {p.program_signature for p in used_b}
    traces_b = {p.trace_signature for p in used_b if p.trace_signature is not None}
    assert set(both.trace_signatures) == set(base.trace_signatures) | traces_b
    assert both.observe(used_b) == both
    assert both.observe(used_a) == both


@given(cases())
def test_manifest_missing_a_used_identity_does_not_cover_it(case):
    """Dropping a request's program (or its trace) from a manifest makes covers() false for it."""
    for prepared in _prepare(case):
        full = WarmupManifest().observe([prepared])
        no_program = attrs.evolve(full, program_signatures=())
        assert not no_program.covers(prepared)
        if prepared.trace_signature is not None:
            assert not attrs.evolve(full, trace_signatures=()).covers(prepared)


def test_empty_manifest_covers_nothing():
    """An empty manifest covers no prepared request."""
    layout = PageTableLayout(32, 64, 64)
    batch = PrefillBatch.from_rows((PrefillRow(100, 0, 0, (0, 1, 2, 3)),))
    (prepared,) = prepare_prefill(batch, PrefillPolicy(), layout)
    assert not WarmupManifest().covers(prepared)
