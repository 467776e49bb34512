"""Cached rows in one wave (``batch_cached_rows``): chat turns behind one cached system prompt, run together.

Each row joins the wave at its own block-aligned cached offset and reads
its prefix through the wave's read table: no block of any cached prefix is
recomputed or written (the shared prefix blocks keep every byte), and each
row's logits and written KV equal the unbatched plan's within 1e-5.
tt-transformers' ``allow_cached_prefix=True`` instead plans such a row from
position 0 and rewrites its cached blocks.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, RequestKind, WarmupManifest
from prefill_shell.engine.executor import PrefillExecutor
from tests.helpers import build_runtime, make_tokens, max_abs_diff, page_table, row_kv

BLOCK = 16
LAYOUT = PageTableLayout(BLOCK, 16, 64)
UNBATCHED = PrefillPolicy(max_chunk_length=256, chunk_quantum=128, length_ladder=(128, 256))
BATCHED = attrs.evolve(UNBATCHED, batch_cached_rows=True)
SYSTEM = 64  # the shared system prompt: 4 blocks
TURNS = (20, None, 50, 90, 7)  # each row's own turn after it; None: an uncached 200-token row between them


def _chat():
    """Token rows (system prompt + turn), each row's blocks (the 4 shared ones first), lengths and cached lengths."""
    system = make_tokens(SYSTEM, seed=1)
    rows = [
        make_tokens(200, seed=9) if n is None else torch.cat((system, make_tokens(n, seed=10 + i)))
        for i, n in enumerate(TURNS)
    ]
    free = iter(range(4, LAYOUT.num_blocks))
    blocks = [([] if n is None else [0, 1, 2, 3]) + [next(free) for _ in range(-(-(n or 200) // BLOCK))] for n in TURNS]
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, blocks, [len(r) for r in rows], [0 if n is None else SYSTEM for n in TURNS]


def _run(model, policy, mode="eager"):
    """Prefills the system prompt alone, then every turn with the prompt cached: (executor, kv before, plan, logits).

    ``mode="traced"``: the turns' call replays traces warmed from its own plan (the system prompt runs eagerly).
    """
    tokens, blocks, lengths, cached = _chat()
    runtime = build_runtime(model, layout=LAYOUT, policy=policy)
    executor = PrefillExecutor(runtime)
    executor.prefill(tokens[:1, :SYSTEM], page_table([blocks[0][:4]]), [SYSTEM], mode="eager")
    kv = runtime.config.kv
    before = [(k.clone(), v.clone()) for k, v in zip(kv.keys, kv.values)]
    call = (tokens, page_table(blocks), lengths, cached)
    prepared = runtime.prepare(*call).requests
    plan = [p.request for p in prepared]
    if mode == "traced":
        executor.warm_up(WarmupManifest().observe(prepared))
    results = executor.prefill(*call, mode=mode)
    return executor, before, plan, [r.logits for r in results]


@pytest.fixture(scope="module")
def runs(tiny_model):
    batched, unbatched = _run(tiny_model, BATCHED), _run(tiny_model, UNBATCHED)
    yield batched, unbatched
    batched[0].close()
    unbatched[0].close()


def test_cached_turns_run_as_one_chunked_wave(runs):
    """The four turns (64 cached, 7-90 new tokens: one 128-token step each from position 64) share one wave."""
    (_, _, plan, _), (_, _, alone, _) = runs
    wave, other = plan
    assert (wave.kind, wave.source_rows, wave.padded_batch) == (RequestKind.CHUNKED, (0, 2, 3, 4), 4)
    assert (wave.first_chunk_start, wave.num_chunks, wave.chunk_length) == (SYSTEM, 1, 128)
    assert other.source_rows == (1,) and len(alone) == 5


def test_no_block_of_the_cached_prefix_is_written(runs):
    """Every byte of the shared system-prompt blocks is what the first call left there."""
    (executor, before, _, _), _ = runs
    kv = executor.runtime.config.kv
    for (k0, v0), k1, v1 in zip(before, kv.keys, kv.values):
        assert torch.equal(k0[:4], k1[:4]) and torch.equal(v0[:4], v1[:4])


def test_a_wave_of_cached_rows_equals_the_unbatched_plan(runs):
    """Logits and every row's KV (its own blocks included) equal the rows run alone within 1e-5."""
    (batched, _, _, logits), (unbatched, _, _, alone) = runs
    for ours, theirs in zip(logits, alone):
        assert max_abs_diff(ours, theirs) < 1e-5
    _, blocks, lengths, _ = _chat()
    kv_a, kv_b = batched.runtime.config.kv, unbatched.runtime.config.kv
    for layer in range(len(kv_a.keys)):
        for row, length in zip(blocks, lengths):
            for a, b in zip(row_kv(kv_a, layer, row, length), row_kv(kv_b, layer, row, length)):
                assert max_abs_diff(a, b) < 1e-5


def test_a_traced_wave_of_cached_rows_equals_the_eager_one(tiny_model, runs):
    """The wave's trace (a chunked body of 4 rows) replays to the eager wave's logits, prefix blocks untouched."""
    (_, _, _, eager), _ = runs
    executor, before, plan, traced = _run(tiny_model, BATCHED, mode="traced")
    try:
        assert plan[0].padded_batch == 4
        for ours, theirs in zip(traced, eager):
            assert max_abs_diff(ours, theirs) < 1e-5
        kv = executor.runtime.config.kv
        assert all(torch.equal(k0[:4], k1[:4]) for (k0, _), k1 in zip(before, kv.keys))
    finally:
        executor.close()
