"""Deterministic planning examples: tt-metal's rules on hand-picked batches."""

from __future__ import annotations

import pytest

from prefill_core import (
    SKIP,
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    RequestKind,
    SamplingParams,
    SamplingPath,
    TableRole,
    plan_prefill,
    prepare_prefill,
)
from prefill_core.values.errors import RepeatedBlockError

BS = 32
LAYOUT = PageTableLayout(block_size=BS, max_num_blocks_per_seq=4096, num_blocks=200_000)
POLICY = PrefillPolicy()
WIDE = PrefillPolicy(lane_size=128)


def batch_of(*specs: tuple[int, int], first_block: int = 0, slots=None) -> PrefillBatch:
    """Rows of ``(length, cached)`` with consecutive disjoint blocks and slots 0..n-1."""
    rows, next_block = [], first_block
    for i, (length, cached) in enumerate(specs):
        need = -(-length // BS)
        rows.append(
            PrefillRow(length, cached, i if slots is None else slots[i], tuple(range(next_block, next_block + need)))
        )
        next_block += need
    return PrefillBatch.from_rows(tuple(rows))


def uncached(*lengths: int, **kwargs) -> PrefillBatch:
    return batch_of(*((n, 0) for n in lengths), **kwargs)


def starts(request) -> list[int]:
    return [chunk.start for chunk in request.chunks]


# ---------------------------------------------------------------- ladder and chunk rules


@pytest.mark.parametrize(
    ("tokens", "padded"),
    [
        (1, 128),
        (128, 128),
        (129, 1024),
        (1024, 1024),
        (1025, 2048),
        (2048, 2048),
        (2049, 4096),
        (4097, 8192),
        (131072, 131072),
    ],
)
def test_default_ladder_is_128_then_1024_then_powers_of_two(tokens, padded):
    """Prompts pad to 128, then 1024, then the next power of two."""
    assert POLICY.padded_length(tokens) == padded


@pytest.mark.parametrize(
    ("max_chunk", "padded", "chunk"),
    [
        (2048, 128, 128),
        (2048, 1024, 1024),
        (2048, 2048, 2048),
        (2048, 8192, 2048),
        (2048, 131072, 2048),
        (4096, 8192, 4096),
        (6144, 8192, 4096),
        (6144, 16384, 4096),
        (8192, 4096, 4096),
    ],
)
def test_chunk_length_is_the_largest_dividing_multiple_of_2048_within_the_max(max_chunk, padded, chunk):
    """The chunk is the padded work when it fits the max, else the largest multiple of 2048 <= max dividing it."""
    assert PrefillPolicy(max_chunk_length=max_chunk).chunk_length(padded, BS) == chunk


def test_chunk_length_falls_back_to_a_block_multiple_when_no_quantum_multiple_divides():
    """With max chunk 1536 (below the 2048 quantum), 4096 tokens of work run in 1024-token chunks (block fallback)."""
    assert PrefillPolicy(max_chunk_length=1536).chunk_length(4096, BS) == 1024


def test_ladder_with_a_32_tier_pads_short_prompts_to_32():
    """A policy ladder starting at 32 pads a 20-token prompt to 32, not 128."""
    policy = PrefillPolicy(length_ladder=(32, 128, 1024))
    assert [policy.padded_length(n) for n in (20, 33, 129, 1025)] == [32, 128, 1024, 2048]


# ---------------------------------------------------------------- chunked requests


def test_4097_tokens_run_three_chunks_of_2048_and_stop():
    """4097 tokens pad to 8192 but run only chunks at 0, 2048 and 4096 (the last holds token 4096)."""
    (request,) = plan_prefill(uncached(4097), POLICY, LAYOUT)
    assert request.kind is RequestKind.CHUNKED
    assert (request.padded_length, request.chunk_length) == (8192, 2048)
    assert starts(request) == [0, 2048, 4096]
    assert [chunk.is_final for chunk in request.chunks] == [False, False, True]
    assert request.last_token_positions == (4096,)


def test_4097_token_final_chunk_writes_only_its_one_real_block():
    """The final chunk of a 4097-token row writes block 128 only; the rest of its table is -1."""
    batch = uncached(4097)
    (request,) = plan_prefill(batch, POLICY, LAYOUT)
    (fill,) = request.fill_table_of(request.final_chunk)
    assert fill[0] == batch.rows[0].blocks[128]
    assert set(fill[1:]) == {SKIP}
    assert len(fill) == 64


def test_chunked_tables_have_rounded_widths_and_filler_read_entries():
    """A 4097-token row reads the layout's 4160-wide full table (mapped blocks, then filler 0), writes 64-wide ones."""
    batch = uncached(4097)
    (request,) = plan_prefill(batch, POLICY, LAYOUT)
    (read,) = request.read_table_values()
    assert request.read_table.role is TableRole.CHUNKED_FULL
    assert len(read) == 4160  # ceil((131072 + 2048 - 1) / 32) = 4160, already a multiple of 8
    assert read[:129] == batch.rows[0].blocks and set(read[129:]) == {0}
    assert request.fill_table.width == request.final_fill_table.width == 64


def test_cached_prefix_starts_chunks_at_the_cached_offset():
    """A 5000-token row with 1024 cached runs chunks at absolute 1024, 3072 (final)."""
    batch = batch_of((5000, 1024))
    (request,) = plan_prefill(batch, POLICY, LAYOUT)
    assert starts(request) == [1024, 3072]
    (first,) = request.fill_table_of(request.chunk(0))
    assert first == batch.rows[0].blocks[32:96]


def test_short_row_with_a_cached_prefix_runs_chunked():
    """A 100-token row with 64 cached tokens is a one-chunk chunked request starting at 64."""
    (request,) = plan_prefill(batch_of((100, 64)), POLICY, LAYOUT)
    assert request.kind is RequestKind.CHUNKED
    assert (request.padded_length, request.chunk_length, starts(request)) == (128, 128, [64])


def test_fully_cached_prompt_reruns_its_final_block_read_only():
    """A fully cached 4096-token prompt runs one 128-token step at 4064 that writes nothing; its last token is 4095."""
    batch = batch_of((4096, 4096))
    (prepared,) = prepare_prefill(batch, POLICY, LAYOUT)
    request = prepared.request
    assert starts(request) == [4096 - BS] and request.chunk_length == 128
    assert request.final_chunk.is_final
    assert request.last_token_positions == (4095,)
    (fill,) = request.fill_table_of(request.final_chunk)
    assert set(fill) == {SKIP}
    (read,) = request.read_table_values()
    assert read[:128] == batch.rows[0].blocks
    assert request.real_tokens == 1


def test_6000_tokens_at_any_cached_offset_share_one_trace():
    """A 6000-token row cached at 0, 2048 or 4096 runs one trace and one program signature."""
    prepared = [prepare_prefill(batch_of((6000, cached)), POLICY, LAYOUT)[0] for cached in (0, 2048, 4096)]
    assert [starts(p.request) for p in prepared] == [[0, 2048, 4096], [2048, 4096], [4096]]
    assert len({p.trace_signature for p in prepared}) == 1
    assert len({p.program_signature for p in prepared}) == 1
    assert prepared[0].trace_signature is not None


# ---------------------------------------------------------------- waves


def test_30_rows_of_128_run_one_wave_of_32_with_two_padding_rows():
    """Thirty uncached 128-token rows form one 32-row wave whose two padding rows are all -1."""
    batch = uncached(*[128] * 30)
    (request,) = plan_prefill(batch, POLICY, LAYOUT)
    assert request.kind is RequestKind.REGULAR_BATCHED
    assert (request.active_batch_size, request.padded_batch) == (30, 32)
    assert request.source_rows == tuple(range(30))
    table = request.fill_table_of(request.chunk(0))
    assert len(table) == 32 and len(table[0]) == 8
    assert table[30] == table[31] == (SKIP,) * 8
    assert table[0] == batch.rows[0].blocks + (SKIP,) * 4


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.7, top_k=10)])
def test_15_and_16_rows_share_padded_geometry_and_signatures(sampling):
    """Waves of 15 and 16 rows both pad to 16 and share program and trace signatures."""
    prepared = []
    for count in (15, 16):
        rows = uncached(*[100] * count).rows
        batch = PrefillBatch.from_rows(tuple(PrefillRow(r.length, 0, r.slot, r.blocks, sampling) for r in rows))
        (p,) = prepare_prefill(batch, POLICY, LAYOUT)
        prepared.append(p)
    a, b = prepared
    assert (
        (a.request.padded_batch, a.request.padded_length)
        == (b.request.padded_batch, b.request.padded_length)
        == (16, 128)
    )
    assert a.program_signature == b.program_signature and a.program_signature.key == b.program_signature.key
    assert a.trace_signature == b.trace_signature and a.trace_signature.key == b.trace_signature.key


def test_slots_7_3_11_run_one_wave_of_4_in_caller_order():
    """Three rows with slots 7, 3 and 11 form one wave of 4 that keeps the caller's row order."""
    (request,) = plan_prefill(uncached(128, 128, 128, slots=(7, 3, 11)), POLICY, LAYOUT)
    assert (request.active_batch_size, request.padded_batch) == (3, 4)
    assert request.slots == (7, 3, 11) and request.source_rows == (0, 1, 2)


def test_33_rows_split_into_a_wave_of_32_and_a_single():
    """A 33-row bucket runs a full 32-row wave, then its leftover row alone."""
    first, second = plan_prefill(uncached(*[128] * 33), WIDE, LAYOUT)
    assert (first.kind, first.active_batch_size, first.padded_batch) == (RequestKind.REGULAR_BATCHED, 32, 32)
    assert (second.kind, second.source_rows, second.padded_batch) == (RequestKind.REGULAR_SINGLE, (32,), 1)


def test_34_rows_split_into_waves_of_32_and_2():
    """A 34-row bucket runs waves of 32 and 2."""
    requests = plan_prefill(uncached(*[128] * 34), WIDE, LAYOUT)
    assert [(r.active_batch_size, r.padded_batch) for r in requests] == [(32, 32), (2, 2)]


def test_token_budget_caps_the_wave_of_long_rows():
    """Twenty 4096-token rows with an 8192 max chunk run waves of 16 and 4 (32 x 4096 is not < 128K)."""
    policy = PrefillPolicy(max_chunk_length=8192)
    requests = plan_prefill(uncached(*[4096] * 20), policy, LAYOUT)
    assert [(r.active_batch_size, r.padded_batch, r.padded_length) for r in requests] == [(16, 16, 4096), (4, 4, 4096)]


def test_rows_batch_only_with_their_own_bucket():
    """Rows of 100, 2000, 120 and 1500 tokens form waves {0, 2} (128) and {1, 3} (2048)."""
    requests = plan_prefill(uncached(100, 2000, 120, 1500), POLICY, LAYOUT)
    assert [(r.source_rows, r.padded_length) for r in requests] == [((0, 2), 128), ((1, 3), 2048)]


def test_cached_and_long_rows_fall_back_to_singles_after_the_waves():
    """Output order: waves first, then singles by source row (cached and long rows never batch)."""
    batch = batch_of((5000, 0), (128, 0), (256, 64), (100, 0))
    requests = plan_prefill(batch, POLICY, LAYOUT)
    assert [(r.kind, r.source_rows) for r in requests] == [
        (RequestKind.REGULAR_BATCHED, (1, 3)),
        (RequestKind.CHUNKED, (0,)),
        (RequestKind.CHUNKED, (2,)),
    ]


def test_batching_disabled_runs_every_row_as_a_regular_single():
    """With batching off, four short rows run as four regular single requests in row order."""
    requests = plan_prefill(uncached(100, 100, 100, 100), PrefillPolicy(batching_enabled=False), LAYOUT)
    assert [(r.kind, r.source_rows, r.padded_batch) for r in requests] == [
        (RequestKind.REGULAR_SINGLE, (i,), 1) for i in range(4)
    ]


def test_logits_rows_and_sampled_rows_run_in_separate_waves():
    """Rows with and without sampling params never share a wave."""
    rows = uncached(*[128] * 4).rows
    greedy = SamplingParams.greedy()
    batch = PrefillBatch.from_rows(
        tuple(PrefillRow(r.length, 0, r.slot, r.blocks, greedy if i % 2 else None) for i, r in enumerate(rows))
    )
    prepared = prepare_prefill(batch, POLICY, LAYOUT)
    assert [(p.request.source_rows, p.sampling_path) for p in prepared] == [
        ((0, 2), SamplingPath.LOGITS),
        ((1, 3), SamplingPath.ARGMAX),
    ]


# ---------------------------------------------------------------- page tables


def test_stale_tail_entries_never_reach_the_device():
    """A 40-token row with a junk tail writes its two blocks, then -1 (the tail is ignored)."""
    batch = PrefillBatch.from_rows((PrefillRow(40, 0, 0, (5, 6, 99, -1, 7)),))
    (request,) = plan_prefill(batch, POLICY, LAYOUT)
    assert request.fill_table_of(request.chunk(0)) == ((5, 6) + (SKIP,) * 6,)


def test_cached_prefix_blocks_may_be_shared_by_rows():
    """Two rows reading the same cached block plan, each writing only its own blocks."""
    batch = PrefillBatch.from_rows((PrefillRow(64, 32, 0, (9, 1)), PrefillRow(64, 32, 1, (9, 2))))
    requests = plan_prefill(batch, POLICY, LAYOUT)
    assert [request.fill_table_of(request.final_chunk)[0][:2] for request in requests] == [(1, SKIP), (2, SKIP)]


@pytest.mark.parametrize(("blocks", "column"), [((7, 7, 8), 1), ((7, 9, 7), 2)])
def test_a_row_may_not_map_one_block_twice_cached_or_written(blocks, column):
    """A block id repeated inside one row's mapped prefix (cached part included) is a RepeatedBlockError."""
    batch = PrefillBatch.from_rows((PrefillRow(96, 64, 0, blocks),))
    with pytest.raises(RepeatedBlockError) as caught:
        plan_prefill(batch, POLICY, LAYOUT)
    assert (caught.value.row, caught.value.field) == (0, f"blocks[{column}]")


def test_regular_table_width_rounds_the_padded_blocks_up_to_8():
    """A 1024-padded row with block size 32 gets a 32-wide table; block size 64 with ladder 128 gets 8."""
    (request,) = plan_prefill(uncached(500), POLICY, LAYOUT)
    assert request.fill_table.width == 32
    layout64 = PageTableLayout(64, 64, 1000)
    (request,) = plan_prefill(PrefillBatch.from_rows((PrefillRow(100, 0, 0, (0, 1)),)), POLICY, layout64)
    assert request.fill_table.width == 8
