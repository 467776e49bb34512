"""Invariant 3 and 14: program and trace identities depend on padded geometry
(plus, for programs, the sampling path) only, and their keys are stable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
from hypothesis import assume, given
from hypothesis import strategies as st

from prefill_core import (
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillProgramSignature,
    PrefillRow,
    PrefillTraceSignature,
    RequestKind,
    SamplingParams,
    SamplingPath,
    from_json,
    manifest_for,
    prepare_prefill,
    to_json,
)
from prefill_core.planning.prepared import prepare_request
from tests.strategies import BLOCK_SIZES, cases, layouts, policies, sampling_params

REPO = Path(__file__).resolve().parents[3]


def _prepare(case):
    return prepare_prefill(case.batch, case.policy, case.layout)


def _identities(prepared):
    return [(p.request.source_rows, p.program_signature, p.trace_signature) for p in prepared]


def _with_rows(case, rows):
    return attrs.evolve(case, batch=PrefillBatch.from_rows(tuple(rows)))


def _lane_batch(lengths_and_cached, block_size, sampling=None, first_block=0):
    rows, block = [], first_block
    for slot, (length, cached) in enumerate(lengths_and_cached):
        need = -(-length // block_size)
        rows.append(PrefillRow(length, cached, slot, tuple(range(block, block + need)), sampling))
        block += need
    return PrefillBatch.from_rows(tuple(rows)), block


# ---------------------------------------------------------------- padded geometry only


@given(cases())
def test_signatures_ignore_slots_and_block_ids(case):
    """Renumbering every slot and every block id (bijectively) leaves every signature unchanged."""
    lane, pool = case.policy.lane_size, case.layout.num_blocks
    rows = [
        attrs.evolve(
            row, slot=lane - 1 - row.slot, blocks=tuple(pool - 1 - b if 0 <= b < pool else b for b in row.blocks)
        )
        for row in case.batch.rows
    ]
    assert _identities(_prepare(_with_rows(case, rows))) == _identities(_prepare(case))


@given(st.data())
def test_signatures_ignore_the_active_row_count_within_a_wave(data):
    """Two waves that pad to the same batch and length share program and trace signatures."""
    bs = data.draw(st.sampled_from(BLOCK_SIZES))
    policy = attrs.evolve(data.draw(policies(bs, min_lane=64)), pad_partial_waves=True)
    length = data.draw(st.integers(1, policy.max_chunk_length))
    padded = policy.padded_length(length)
    largest = policy.max_wave_for(padded)
    assume(policy.batching_enabled and largest >= 2 and padded <= policy.max_chunk_length)
    wave = data.draw(st.sampled_from([w for w in policy.waves if 2 <= w <= largest]))
    smaller = [w for w in policy.waves if w < wave]
    low = max(2, smaller[-1] + 1 if smaller else 2)
    counts = data.draw(st.lists(st.integers(low, wave), min_size=2, max_size=2))
    same_bucket = st.integers(1, padded).filter(lambda n: policy.padded_length(n) == padded)
    prepared = []
    for count in counts:
        lengths = data.draw(st.lists(same_bucket, min_size=count, max_size=count))
        batch, used = _lane_batch([(n, 0) for n in lengths], bs)
        (p,) = prepare_prefill(batch, policy, PageTableLayout(bs, -(-padded // bs), used))
        assert (p.request.active_batch_size, p.request.padded_batch) == (count, wave)
        prepared.append(p)
    a, b = prepared
    assert a.program_signature == b.program_signature and a.trace_signature == b.trace_signature


@given(st.data())
def test_signatures_ignore_the_cached_offset_and_chunk_starts(data):
    """A chunked row's signatures are the same at every cached offset that gives the same chunk length."""
    bs = data.draw(st.sampled_from(BLOCK_SIZES))
    policy = data.draw(policies(bs))
    length = data.draw(st.integers(bs, 40_000))
    whole = length // bs
    lowest = 0 if policy.padded_length(length) > policy.max_chunk_length else 1
    offsets = data.draw(st.lists(st.integers(lowest, whole).map(lambda k: k * bs), min_size=2, max_size=3))
    layout = PageTableLayout(bs, -(-length // bs), -(-length // bs))
    prepared = [prepare_prefill(_lane_batch([(length, cached)], bs)[0], policy, layout)[0] for cached in offsets]
    assert all(p.request.kind is RequestKind.CHUNKED for p in prepared)
    by_chunk: dict[int, list] = {}
    for p in prepared:
        by_chunk.setdefault(p.request.chunk_length, []).append(p)
    for same in by_chunk.values():
        assert len({p.program_signature for p in same}) == 1
        assert len({p.trace_signature for p in same}) == 1


def test_rows_112_cached_32_and_144_cached_64_share_one_trace():
    """(112, 32 cached) and (144, 64 cached) at block 32 on the default ladder run one 128-token body, one trace."""
    batch, used = _lane_batch([(112, 32), (144, 64)], 32)
    layout = PageTableLayout(32, 256, used)
    first, second = prepare_prefill(batch, PrefillPolicy(), layout)
    assert first.request.padded_length != second.request.padded_length  # rungs 128 and 1024
    assert (first.request.chunk_length, second.request.chunk_length) == (128, 128)
    assert first.trace_signature == second.trace_signature
    assert first.program_signature == second.program_signature


@given(st.data())
def test_every_cached_offset_at_one_chunk_length_shares_one_trace(data):
    """In one layout, chunked rows of any length and cached offset that get the same chunk length share one trace."""
    bs = data.draw(st.sampled_from(BLOCK_SIZES))
    policy = data.draw(policies(bs))
    layout = data.draw(layouts(bs, min_capacity=bs))
    lengths = st.integers(bs, layout.capacity)
    rows = []
    for length in data.draw(st.lists(lengths, min_size=2, max_size=6)):
        lowest = 0 if policy.padded_length(length) > policy.max_chunk_length else 1
        rows.append((length, data.draw(st.integers(lowest, length // bs)) * bs))
    by_geometry: dict[tuple[int, int], set] = {}
    for length, cached in rows:
        batch, used = _lane_batch([(length, cached)], bs)
        (p,) = prepare_prefill(batch, policy, attrs.evolve(layout, num_blocks=max(used, 1)))
        assert p.request.kind is RequestKind.CHUNKED
        by_geometry.setdefault((p.request.chunk_length, p.request.padded_batch), set()).add(p.trace_signature)
    assert all(len(traces) == 1 for traces in by_geometry.values())


@given(cases())
def test_a_plans_chunked_requests_have_one_trace_per_chunk_length(case):
    """Within any plan, chunked requests of one chunk length and padded batch have one trace signature."""
    by_geometry: dict[tuple[int, int], set] = {}
    for p in _prepare(case):
        if p.request.kind is RequestKind.CHUNKED:
            key = (p.request.chunk_length, p.request.padded_batch)
            by_geometry.setdefault(key, set()).add(p.trace_signature)
    assert all(len(traces) == 1 for traces in by_geometry.values())


# ---------------------------------------------------------------- sampling


@given(cases(), st.data())
def test_trace_signature_never_depends_on_sampling(case, data):
    """Giving every row the same sampling params (or none) changes no trace signature."""
    params = data.draw(st.none() | sampling_params(case.policy.max_logprobs))
    plain = _prepare(_with_rows(case, [attrs.evolve(r, sampling=None) for r in case.batch.rows]))
    sampled = _prepare(_with_rows(case, [attrs.evolve(r, sampling=params) for r in case.batch.rows]))
    assert [(p.request.source_rows, p.trace_signature) for p in sampled] == [
        (p.request.source_rows, p.trace_signature) for p in plain
    ]
    for p in sampled:
        assert p.trace_signature is None or p.trace_signature == p.program_signature.body


SAMPLINGS = {
    "none": None,
    "greedy": SamplingParams.greedy(),
    "greedy+logprobs": SamplingParams.greedy(num_logprobs=3),
    "topk": SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
    "topk+logprobs": SamplingParams(temperature=0.8, top_k=5, num_logprobs=2),
    "host": SamplingParams(temperature=1.0, top_k=0),
    "host+logprobs": SamplingParams(temperature=1.0, top_k=0, num_logprobs=2),
}


@given(cases())
def test_program_signature_changes_exactly_with_sampling_path_or_logprobs(case):
    """Two samplings of one request share a program signature iff they share sampling path and log-probs."""
    for prepared in _prepare(case):
        request = prepared.request
        variants = []
        for params in SAMPLINGS.values():
            if params is not None and params.num_logprobs > case.policy.max_logprobs:
                params = attrs.evolve(params, num_logprobs=case.policy.max_logprobs)
            p = prepare_request(attrs.evolve(request, sampling=(params,) * request.active_batch_size), case.policy)
            variants.append(p)
        for a in variants:
            for b in variants:
                same_choice = (a.sampling_path, a.program_signature.logprobs) == (
                    b.sampling_path,
                    b.program_signature.logprobs,
                )
                assert (a.program_signature == b.program_signature) == same_choice
                assert a.trace_signature == b.trace_signature


def test_each_sampling_path_and_logprobs_setting_has_its_own_program():
    """Logits, argmax, top-k and host sampling, with and without log-probs, give six distinct programs."""
    layout = PageTableLayout(32, 64, 64)
    keys = {}
    for name, params in SAMPLINGS.items():
        batch, _ = _lane_batch([(100, 0)], 32, sampling=params)
        (p,) = prepare_prefill(batch, PrefillPolicy(), layout)
        keys[name] = (p.sampling_path, p.program_signature.logprobs, p.program_signature.key)
    assert keys["none"][:2] == (SamplingPath.LOGITS, False)
    assert keys["greedy"][:2] == (SamplingPath.ARGMAX, False)
    assert keys["greedy+logprobs"][:2] == (SamplingPath.ARGMAX, True)
    assert keys["topk"][:2] == (SamplingPath.TOPK, False)
    assert keys["topk+logprobs"][:2] == (SamplingPath.TOPK, True)
    assert keys["host"][:2] == keys["host+logprobs"][:2] == (SamplingPath.HOST, False)
    assert len({k for _, _, k in keys.values()}) == 6


@given(cases())
def test_static_last_token_tile_is_in_the_program_only_when_the_policy_bakes_it(case):
    """A regular single's program carries its last token's 32-row tile exactly when the policy asks."""
    for prepared in _prepare(case):
        request, tile = prepared.request, prepared.program_signature.last_token_tile
        if case.policy.static_last_token_tile and request.kind is RequestKind.REGULAR_SINGLE:
            assert tile == (request.lengths[0] - 1) // case.policy.tile_size * case.policy.tile_size
        else:
            assert tile is None


# ---------------------------------------------------------------- keys


GOLDEN = {
    "trace-45f5a60b133fe765": PrefillTraceSignature(RequestKind.REGULAR_BATCHED, 32, 128, 8, 0),
    "trace-4dedcedbaf093c0a": PrefillTraceSignature(RequestKind.CHUNKED, 1, 2048, 64, 320),
    "prog-001a13154cb28bdc": PrefillProgramSignature(
        RequestKind.CHUNKED, 1, 2048, 64, 320, SamplingPath.TOPK, True, None
    ),
    "prog-4d2ef26cf33317da": PrefillProgramSignature(
        RequestKind.REGULAR_SINGLE, 1, 128, 8, 0, SamplingPath.LOGITS, False, 96
    ),
}


def test_golden_signature_keys_are_pinned():
    """Four fixed signatures keep the exact keys recorded when the key scheme was introduced."""
    assert {signature.key: signature for signature in GOLDEN.values()} == GOLDEN


def test_golden_chunked_signature_is_what_a_4097_token_row_plans():
    """The pinned chunked identities are exactly those of a 4097-token row with top-k and log-probs."""
    batch, used = _lane_batch([(4097, 0)], 32, sampling=SamplingParams(temperature=0.5, top_k=8, num_logprobs=1))
    (p,) = prepare_prefill(batch, PrefillPolicy(), PageTableLayout(32, 256, used))
    assert (p.program_signature.key, p.trace_signature.key) == ("prog-001a13154cb28bdc", "trace-4dedcedbaf093c0a")


@given(cases())
def test_signature_keys_survive_a_json_round_trip(case):
    """A signature read back from JSON is equal and has the same key."""
    for p in _prepare(case):
        for signature, kind in (
            (p.program_signature, PrefillProgramSignature),
            (p.trace_signature, PrefillTraceSignature),
        ):
            if signature is None:
                continue
            back = from_json(kind, to_json(signature))
            assert back == signature and back.key == signature.key


def test_signature_keys_are_the_same_in_a_fresh_interpreter():
    """Keys recomputed from JSON in a new Python process equal this process's keys."""
    layout = PageTableLayout(32, 256, 1)
    manifest = manifest_for(PrefillPolicy(static_last_token_tile=True), layout)
    payload = json.dumps(
        {
            "programs": [to_json(s) for s in manifest.program_signatures],
            "traces": [to_json(s) for s in manifest.trace_signatures],
        }
    )
    script = (
        "import json, sys\n"
        "from prefill_core import PrefillProgramSignature as P, PrefillTraceSignature as T, from_json\n"
        "data = json.load(sys.stdin)\n"
        "keys = [from_json(P, s).key for s in data['programs']] + [from_json(T, s).key for s in data['traces']]\n"
        "print(json.dumps(keys))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONHASHSEED="12345")
    result = subprocess.run(
        [sys.executable, "-c", script], input=payload, capture_output=True, text=True, env=env, cwd=REPO, check=True
    )
    expected = [s.key for s in manifest.program_signatures] + [s.key for s in manifest.trace_signatures]
    assert json.loads(result.stdout) == expected
    assert len(expected) > 100


@given(cases())
def test_distinct_signatures_have_distinct_keys(case):
    """No two different signatures in a policy's manifest share a key."""
    manifest = manifest_for(case.policy, case.layout)
    for signatures in (manifest.program_signatures, manifest.trace_signatures):
        assert len({s.key for s in signatures}) == len(set(signatures)) == len(signatures)
