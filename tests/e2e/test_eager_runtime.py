"""The eager runtime end to end against transformers' Llama on the same weights.

Every logits check compares a row's last-token logits with the oracle run on
that row alone, unpadded; every KV check compares pool contents with the
oracle's cache. Most tests use the small chunking policy (chunks of 256) so
chunking happens at short lengths; the issue's named cases use the defaults.
"""

from __future__ import annotations

import random

import pytest
import torch

from prefill_core import PrefillPolicy, SamplingParams
from prefill_core.planning.request import RequestKind
from tests.helpers import (
    CHUNK_256_POLICY,
    TOL,
    assign_blocks,
    build_runtime,
    make_tokens,
    max_abs_diff,
    page_table,
    randomize_pool,
    row_kv,
    token_matrix,
)

BS_SMALL = 16  # block size with the small policy
BS_DEFAULT = 64  # block size with the default policy (2048-token chunks)


def _plan_rows(batch) -> list[int]:
    return [row for prepared in batch.requests for row in prepared.request.source_rows]


# ---------------------------------------------------------------- logits


def test_single_row_logits_match_oracle(tiny_model, oracle):
    """One 100-token row returns the oracle's last-token logits."""
    rt = build_runtime(tiny_model, num_blocks=16, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    tokens = make_tokens(100, seed=1)
    blocks = assign_blocks([100], BS_SMALL, 16, seed=1)
    (result,) = rt.prefill(tokens[None], page_table(blocks), [100])
    assert result.row == 0 and result.token is None
    assert result.logits.dtype == torch.float32
    assert max_abs_diff(result.logits, oracle.logits(tokens)) <= TOL


def test_wave_of_15_rows_is_padded_to_16_and_each_row_matches_oracle(tiny_model, oracle):
    """Fifteen rows of mixed lengths run as one wave padded to 16, each row with its own oracle logits."""
    rt = build_runtime(tiny_model, num_blocks=128, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    lengths = [20 + (37 * i) % 109 for i in range(15)]
    rows = [make_tokens(n, seed=100 + i) for i, n in enumerate(lengths)]
    table = page_table(assign_blocks(lengths, BS_SMALL, 128, seed=2))
    batch = rt.prepare(token_matrix(rows), table, lengths)
    assert len(batch.requests) == 1
    request = batch.requests[0].request
    assert (request.active_batch_size, request.padded_batch) == (15, 16)
    results = rt.assemble(rt.invocations(batch), batch.num_rows)
    for i, tokens in enumerate(rows):
        assert results[i].row == i
        assert max_abs_diff(results[i].logits, oracle.logits(tokens)) <= TOL, f"row {i}"


@pytest.fixture(scope="module")
def chunked_5000(tiny_model):
    """A 5000-token row prefilled with tt-metal's ladder (2048-token chunks): (tokens, blocks, batch, logits, kv)."""
    rt = build_runtime(tiny_model, num_blocks=96, block_size=BS_DEFAULT, policy=PrefillPolicy())
    tokens = make_tokens(5000, seed=5000)
    blocks = assign_blocks([5000], BS_DEFAULT, 96, seed=5)
    batch = rt.prepare(tokens[None], page_table(blocks), [5000])
    (result,) = rt.assemble(rt.invocations(batch), batch.num_rows)
    return tokens, blocks[0], batch, result.logits, rt.config.kv


def test_cpu_default_policy_runs_5000_tokens_in_fine_chunks(tiny_model):
    """Without a policy, the CPU backend packs 5000 tokens into steps of 2048, 2048 and 904 real tokens; planned
    padded (a traced call), its fine rungs run them as four 1280-token chunks (5120 positions)."""
    rt = build_runtime(tiny_model, num_blocks=96, block_size=BS_DEFAULT)
    blocks = assign_blocks([5000], BS_DEFAULT, 96, seed=5)
    tokens, table = make_tokens(5000, seed=5000)[None], page_table(blocks)
    packed = rt.prepare(tokens, table, [5000]).requests[0].request
    assert packed.kind is RequestKind.PACKED and [step.tokens for step in packed.steps] == [2048, 2048, 904]
    request = rt.prepare(tokens, table, [5000], mode="traced").requests[0].request
    assert (request.chunk_length, request.num_chunks) == (1280, 4)


def test_5000_token_row_chunked_by_2048_matches_oracle(chunked_5000, oracle):
    """A 5000-token row runs as three 2048-token chunks and returns the oracle's last-token logits."""
    tokens, _, batch, logits, _ = chunked_5000
    request = batch.requests[0].request
    assert request.kind is RequestKind.CHUNKED
    assert (request.chunk_length, request.num_chunks) == (2048, 3)
    assert max_abs_diff(logits, oracle.logits(tokens)) <= TOL


def test_5000_token_row_chunked_matches_same_row_unchunked(chunked_5000, tiny_model):
    """The chunked 5000-token row gives the logits of the same row run as one unchunked 8192 invocation."""
    tokens, _, _, chunked_logits, _ = chunked_5000
    rt = build_runtime(tiny_model, num_blocks=96, block_size=BS_DEFAULT, policy=PrefillPolicy(max_chunk_length=8192))
    blocks = assign_blocks([5000], BS_DEFAULT, 96, seed=6)
    batch = rt.prepare(tokens[None], page_table(blocks), [5000])
    request = batch.requests[0].request
    assert request.kind is RequestKind.REGULAR_SINGLE and request.num_chunks == 1
    (result,) = rt.assemble(rt.invocations(batch), batch.num_rows)
    assert max_abs_diff(result.logits, chunked_logits) <= TOL


def test_row_with_2048_of_3000_tokens_cached_matches_full_oracle(tiny_model, oracle):
    """A 3000-token row with its first 2048 tokens cached runs only its tail and matches the full-row oracle."""
    rt = build_runtime(tiny_model, num_blocks=64, block_size=BS_DEFAULT)
    tokens = make_tokens(3000, seed=3000)
    blocks = assign_blocks([3000], BS_DEFAULT, 64, seed=7)
    prefix_blocks = [blocks[0][: 2048 // BS_DEFAULT]]
    rt.prefill(tokens[None, :2048], page_table(prefix_blocks), [2048])
    batch = rt.prepare(tokens[None], page_table(blocks), [3000], cached_lengths=[2048], mode="traced")
    request = batch.requests[0].request
    assert request.kind is RequestKind.CHUNKED
    assert [c.start for c in request.chunks] == [2048]
    (result,) = rt.assemble(rt.invocations(batch), batch.num_rows)
    assert max_abs_diff(result.logits, oracle.logits(tokens)) <= TOL


def test_several_prefix_cached_rows_in_one_call_match_oracle(tiny_model, oracle):
    """Rows with different cached prefixes in one call (small policy, tails chunked) each match the full-row oracle."""
    rt = build_runtime(tiny_model, num_blocks=96, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    lengths, cached = [300, 200, 530], [128, 64, 256]
    rows = [make_tokens(n, seed=310 + i) for i, n in enumerate(lengths)]
    blocks = assign_blocks(lengths, BS_SMALL, 96, seed=8)
    prefixes = [r[:c] for r, c in zip(rows, cached)]
    prefix_blocks = [b[: c // BS_SMALL] for b, c in zip(blocks, cached)]
    rt.prefill(token_matrix(prefixes), page_table(prefix_blocks), cached)
    results = rt.prefill(token_matrix(rows), page_table(blocks), lengths, cached_lengths=cached)
    for i, tokens in enumerate(rows):
        assert max_abs_diff(results[i].logits, oracle.logits(tokens)) <= TOL, f"row {i}"


def test_mixed_batch_in_shuffled_order_returns_results_in_caller_order(tiny_model, oracle):
    """Wave, chunked, cached and greedy rows given shuffled come back in caller order, each matching its oracle."""
    specs = [  # (length, cached, greedy)
        (40, 0, False),
        (300, 0, False),
        (100, 0, False),
        (250, 0, False),
        (77, 0, True),
        (200, 64, False),
        (128, 0, False),
        (240, 0, True),
        (17, 0, False),
        (33, 0, True),
    ]
    random.Random(9).shuffle(specs)
    lengths = [n for n, _, _ in specs]
    cached = [c for _, c, _ in specs]
    rows = [make_tokens(n, seed=400 + n) for n in lengths]
    rt = build_runtime(tiny_model, num_blocks=128, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    blocks = assign_blocks(lengths, BS_SMALL, 128, seed=9)
    c = cached.index(64)
    rt.prefill(rows[c][None, :64], page_table([blocks[c][:4]]), [64])
    sampling = [SamplingParams.greedy() if greedy else None for _, _, greedy in specs]
    batch = rt.prepare(token_matrix(rows), page_table(blocks), lengths, cached_lengths=cached, sampling=sampling)
    assert _plan_rows(batch) != list(range(len(rows)))  # the plan reorders rows
    results = rt.assemble(rt.invocations(batch), batch.num_rows)
    assert [r.row for r in results] == list(range(len(rows)))
    for i, tokens in enumerate(rows):
        expected = oracle.logits(tokens)
        if sampling[i] is None:
            assert max_abs_diff(results[i].logits, expected) <= TOL, f"row {i}"
        else:
            assert results[i].token == int(expected.argmax()), f"row {i}"


def test_fully_cached_row_returns_oracle_last_token_logits(tiny_model, oracle):
    """A row whose every token is cached (cached == length) still returns the oracle's last-token logits."""
    rt = build_runtime(tiny_model, num_blocks=32, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    tokens = make_tokens(160, seed=160)
    table = page_table(assign_blocks([160], BS_SMALL, 32, seed=10))
    rt.prefill(tokens[None], table, [160])
    batch = rt.prepare(tokens[None], table, [160], cached_lengths=[160])
    assert batch.requests[0].request.final_fill_table.real_blocks == (0,)  # a read-only re-run
    (result,) = rt.assemble(rt.invocations(batch), batch.num_rows)
    assert max_abs_diff(result.logits, oracle.logits(tokens)) <= TOL


def test_fully_cached_row_leaves_pool_bit_identical(tiny_model):
    """Re-running a fully cached row writes no KV block (the sink aside)."""
    rt = build_runtime(tiny_model, num_blocks=32, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    tokens = make_tokens(160, seed=161)
    table = page_table(assign_blocks([160], BS_SMALL, 32, seed=11))
    rt.prefill(tokens[None], table, [160])
    kv = rt.config.kv
    before = kv.snapshot().view(torch.uint8)
    rt.prefill(tokens[None], table, [160], cached_lengths=[160])
    assert torch.equal(kv.snapshot().view(torch.uint8), before)


# ---------------------------------------------------------------- KV pool contents


def _assert_pool_holds_oracle_kv(kv, oracle, rows, blocks, first=0):
    """Positions ``[first, len)`` of every row, in every layer, equal the oracle's keys and values."""
    for i, (tokens, row_blocks) in enumerate(zip(rows, blocks)):
        keys, values = oracle.kv(tokens)
        for layer in range(len(keys)):
            got_k, got_v = row_kv(kv, layer, row_blocks, len(tokens))
            assert max_abs_diff(got_k[:, first:], keys[layer][:, first:]) <= TOL, f"row {i} layer {layer} keys"
            assert max_abs_diff(got_v[:, first:], values[layer][:, first:]) <= TOL, f"row {i} layer {layer} values"


def test_pool_holds_oracle_kv_after_regular_wave(tiny_model, oracle):
    """After a padded wave, every position each row wrote holds the oracle's key and value."""
    rt = build_runtime(tiny_model, num_blocks=64, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    randomize_pool(rt.config.kv, seed=12)
    lengths = [40, 128, 77, 5, 99, 64]
    rows = [make_tokens(n, seed=500 + i) for i, n in enumerate(lengths)]
    blocks = assign_blocks(lengths, BS_SMALL, 64, seed=12)
    batch = rt.prepare(token_matrix(rows), page_table(blocks), lengths)
    assert [p.request.padded_batch for p in batch.requests] == [8]
    rt.assemble(rt.invocations(batch), batch.num_rows)
    _assert_pool_holds_oracle_kv(rt.config.kv, oracle, rows, blocks)


def test_pool_holds_oracle_kv_after_chunked_row(tiny_model, oracle):
    """After a 600-token row runs in three 256-token chunks, its every position holds the oracle's key and value."""
    rt = build_runtime(tiny_model, num_blocks=48, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    randomize_pool(rt.config.kv, seed=13)
    tokens = make_tokens(600, seed=600)
    blocks = assign_blocks([600], BS_SMALL, 48, seed=13)
    batch = rt.prepare(tokens[None], page_table(blocks), [600])
    assert batch.requests[0].request.num_chunks == 3
    rt.assemble(rt.invocations(batch), batch.num_rows)
    _assert_pool_holds_oracle_kv(rt.config.kv, oracle, [tokens], blocks)


def test_pool_holds_oracle_kv_after_5000_token_chunked_row(chunked_5000, oracle):
    """The 5000-token row chunked by 2048 leaves the oracle's keys and values at all 5000 positions."""
    tokens, blocks, _, _, kv = chunked_5000
    _assert_pool_holds_oracle_kv(kv, oracle, [tokens], [blocks])


def _prefix_cached_430(tiny_model):
    """A 430-token row: its first 160 tokens prefilled, then the whole row with cached 160, on a noisy pool.

    Returns (runtime, tokens, blocks, prefix-block bytes after the first call).
    """
    rt = build_runtime(tiny_model, num_blocks=48, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    kv = rt.config.kv
    randomize_pool(kv, seed=14)
    tokens = make_tokens(430, seed=430)
    blocks = assign_blocks([430], BS_SMALL, 48, seed=14)
    rt.prefill(tokens[None, :160], page_table([blocks[0][:10]]), [160])
    prefix_bytes = [kv.block_bytes(b) for b in blocks[0][:10]]
    rt.prefill(tokens[None], page_table(blocks), [430], cached_lengths=[160])
    return rt, tokens, blocks, prefix_bytes


def test_pool_holds_oracle_kv_after_prefix_cached_row(tiny_model, oracle):
    """A prefix fill then a cached-160 call leave the oracle's keys and values at all 430 positions."""
    rt, tokens, blocks, _ = _prefix_cached_430(tiny_model)
    _assert_pool_holds_oracle_kv(rt.config.kv, oracle, [tokens], blocks)


def test_prefix_cached_row_does_not_rewrite_its_cached_blocks(tiny_model):
    """The cached-prefix blocks are only read by the cached call: their bytes are unchanged by it."""
    rt, _, blocks, prefix_bytes = _prefix_cached_430(tiny_model)
    kv = rt.config.kv
    for block, expected in zip(blocks[0][:10], prefix_bytes):
        assert torch.equal(kv.block_bytes(block), expected), f"block {block}"


# ---------------------------------------------------------------- isolation


def test_padding_rows_and_stale_page_table_tails_write_nothing(tiny_model):
    """With junk tails naming other rows' blocks and free ones, only mapped blocks change; others are bit-identical."""
    num_blocks = 192
    rt = build_runtime(tiny_model, num_blocks=num_blocks, block_size=BS_SMALL, policy=CHUNK_256_POLICY)
    kv = rt.config.kv
    randomize_pool(kv, seed=15)
    lengths = [20 + (29 * i) % 109 for i in range(15)] + [400]  # a wave of 15 (padded to 16) and a chunked row
    rows = [make_tokens(n, seed=700 + i) for i, n in enumerate(lengths)]
    blocks = assign_blocks(lengths, BS_SMALL, num_blocks, seed=15)
    owned = {b for row in blocks for b in row}
    free = sorted(set(range(num_blocks)) - owned)
    assert 0 in free and len(free) >= 8  # block 0 is the chunked read table's filler
    tails = [blocks[(i + 1) % len(blocks)][:6] + free[i % 4 :: 4][:3] for i in range(len(blocks))]
    table = page_table(blocks, width=40, tails=tails)
    batch = rt.prepare(token_matrix(rows), table, lengths)
    shapes = sorted((p.request.kind.value, p.request.active_batch_size, p.request.padded_batch) for p in batch.requests)
    assert shapes == [("chunked", 1, 1), ("regular_batched", 15, 16)]
    before = {b: kv.block_bytes(b) for b in range(num_blocks)}
    rt.assemble(rt.invocations(batch), batch.num_rows)
    changed = {b for b in range(num_blocks) if not torch.equal(kv.block_bytes(b), before[b])}
    assert changed == owned
