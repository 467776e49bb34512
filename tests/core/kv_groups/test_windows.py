"""Sliding windows and KV groups in the core: what a step reads and writes per group, and the hybrid plan."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from prefill_core import (
    BlockConflictError,
    InvalidLayoutError,
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    RepeatedBlockError,
    WindowTableError,
    from_json,
    manifest_for,
    to_json,
)
from prefill_core.kv_groups.attention_layout import AttentionKind, AttentionLayout, KVGroup
from prefill_core.kv_groups.group_tables import OUTSIDE, prepare_grouped
from prefill_core.kv_groups.windows import (
    hit_blocks_needed,
    kept_columns,
    positions_read,
    read_columns,
    read_span,
    reused_span,
    window_floor,
)
from prefill_core.planning.signatures import PrefillTraceSignature
from prefill_core.values.computed_positions import computed_start, written_columns
from prefill_core.values.intmath import ceil_div
from tests.core.vllm_sliding import first_kept_after, longest_sliding_hit, sliding_table_after_hit
from tests.strategies import policies

NULL = 0  # vLLM's null block: never written, never a real block of a row
FOREIGN = 10_000  # ids at and past it stand for blocks freed from a row and now held by another request


# ---------------------------------------------------------------- the window rule


@given(st.integers(0, 300), st.integers(1, 64))
def test_a_query_sees_exactly_the_keys_within_its_window(query, window):
    """transformers' and vLLM's rule: key k is visible to query q when q - window < k <= q."""
    visible = [k for k in range(query + 1) if query - window < k]
    assert list(read_span(query, query + 1, window)) == visible
    assert window_floor(query, None) == 0


@given(st.integers(0, 300), st.integers(1, 200), st.one_of(st.none(), st.integers(1, 64)))
def test_positions_read_is_the_sum_of_each_querys_visible_keys(start, length, window):
    """``positions_read`` counts, query by query, the keys the window admits."""
    end = start + length
    brute = sum(len(read_span(q, q + 1, window)) for q in range(start, end))
    assert positions_read(start, end, window) == brute


@pytest.mark.parametrize(
    ("window", "bs", "blocks"), [(4096, 32, 128), (1024, 16, 64), (8, 4, 2), (1, 16, 0), (17, 16, 1)]
)
def test_a_sliding_hit_needs_the_blocks_vllm_keeps(window, bs, blocks):
    """``hit_blocks_needed`` is vLLM's ``sliding_window_contiguous_blocks``: ceil((window - 1) / block_size)."""
    assert hit_blocks_needed(window, bs) == blocks
    cached = 40 * bs
    kept = kept_columns(cached + 1, cached, window, bs)
    assert cached // bs - kept.start == min(blocks, cached // bs)


@given(st.integers(1, 400), st.data(), st.integers(1, 70), st.sampled_from((4, 8, 16, 32)))
def test_a_row_keeps_exactly_the_blocks_vllm_has_not_freed(length, data, window, bs):
    """The first kept column is vLLM's ``remove_skipped_blocks`` line at ``num_computed_tokens = cached``."""
    cached = data.draw(st.integers(0, length - 1))
    assert kept_columns(length, cached, window, bs).start == first_kept_after(cached, window, bs)
    assert kept_columns(length, cached, None, bs) == range(0, ceil_div(length, bs))


@given(st.integers(2, 400), st.data(), st.integers(1, 70), st.sampled_from((8, 16)))
def test_a_step_starting_inside_a_cached_block_reuses_its_cached_positions_above_the_floor(length, data, window, bs):
    """A padded step from ``computed_start`` takes ``[start, cached)`` above the floor from the pool."""
    cached = data.draw(st.integers(1, length - 1))
    start = computed_start(length, cached, bs)
    floor = kept_columns(length, cached, window, bs).start
    span = reused_span(start, start + 64, cached, floor, bs)
    assert span == range(max(start, floor * bs), cached)
    assert all(p // bs >= floor for p in span)
    later = reused_span(start + 64, start + 128, cached, floor, bs)
    assert not later or start + 64 < cached


# ---------------------------------------------------------------- the attention layout


def test_layer_types_group_by_kind_in_order_of_first_layer():
    """``from_layer_types``: one group per kind, in order of first appearance (vLLM's grouping: test_kv_grouping)."""
    types = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    layout = AttentionLayout.from_layer_types(types, sliding_window=512, block_size=32)
    assert [g.kind for g in layout.groups] == [AttentionKind.SLIDING, AttentionKind.FULL]
    assert layout.groups[0].layers == (0, 1, 2, 3, 4, 6, 7) and layout.groups[1].layers == (5,)
    assert layout.group_of(5) == 1 and layout.is_hybrid and layout.num_layers == 8
    assert not AttentionLayout.full(4, 32).is_hybrid


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: KVGroup(AttentionKind.SLIDING, None, 16, (0,)), "window"),
        (lambda: KVGroup(AttentionKind.FULL, 64, 16, (0,)), "window"),
        (lambda: KVGroup(AttentionKind.FULL, None, 24, (0,)), "block_size"),
        (lambda: KVGroup(AttentionKind.FULL, None, 16, (1, 0)), "layers"),
        (lambda: AttentionLayout((KVGroup(AttentionKind.FULL, None, 16, (0, 2)),)), "groups"),
        (
            lambda: AttentionLayout.from_layer_types(["linear_attention"], sliding_window=8, block_size=16),
            "layer_types",
        ),
    ],
)
def test_a_bad_attention_layout_is_a_named_error(build, field):
    """Every malformed group or layout names its field."""
    with pytest.raises(InvalidLayoutError) as raised:
        build()
    assert raised.value.field == field


# ---------------------------------------------------------------- hybrid calls


@attrs.frozen
class HybridCase:
    attention: AttentionLayout
    layout: PageTableLayout
    policy: PrefillPolicy
    lengths: tuple[int, ...]
    cached: tuple[int, ...]
    tables: tuple[tuple[tuple[int, ...], ...], ...]  # [group][row]
    kept: tuple[tuple[range, ...], ...]  # [group][row]

    def batch(self, tables=None) -> PrefillBatch:
        tables = self.tables if tables is None else tables
        n = len(self.lengths)
        return PrefillBatch(self.lengths, self.cached, tuple(range(n)), tables[0], (None,) * n)

    def prepare(self, tables=None):
        tables = self.tables if tables is None else tables
        return prepare_grouped(self.batch(tables), self.policy, self.layout, self.attention, tables, null_block=NULL)


PATTERNS = (
    ("sliding_attention",) * 3,  # Mistral: every layer slides
    ("full_attention", "sliding_attention", "sliding_attention", "full_attention"),  # Qwen3 layer_types
    ("sliding_attention",) * 5 + ("full_attention",),  # Gemma 3: group 0 slides
)


@st.composite
def hybrid_cases(draw, max_rows: int = 4) -> HybridCase:
    """A hybrid call whose tables map fresh blocks in every kept column and junk everywhere else."""
    bs = draw(st.sampled_from((16, 32)))
    attention = AttentionLayout.from_layer_types(
        draw(st.sampled_from(PATTERNS)),
        sliding_window=draw(st.one_of(st.integers(1, 3 * bs), st.sampled_from((bs, bs + 1, 2 * bs - 1)))),
        block_size=bs,
        sliding_block_size=draw(st.sampled_from((bs, bs // 2))),
    )
    policy = draw(policies(bs, min_lane=max_rows))
    width = 512 // bs
    layout = PageTableLayout(bs, width, FOREIGN)
    lengths, cached = [], []
    for _ in range(draw(st.integers(1, max_rows))):
        n = draw(st.integers(1, 500))
        lengths.append(n)
        cached.append(draw(st.one_of(st.just(0), st.integers(0, n), st.just(n))))
    fresh = iter(range(NULL + 1, FOREIGN))
    junk = st.one_of(st.just(NULL), st.integers(FOREIGN, 2 * FOREIGN))
    tables, kept = [], []
    for group in attention.groups:
        rows, spans = [], []
        for n, c in zip(lengths, cached):
            keep = kept_columns(n, c, group.window, group.block_size)
            need = ceil_div(n, group.block_size)
            row = [next(fresh) if j in keep else draw(junk) for j in range(need)]
            rows.append(tuple(row) + tuple(draw(st.lists(junk, max_size=2))))  # a stale tail past the prompt
            spans.append(keep)
        tables.append(tuple(rows))
        kept.append(tuple(spans))
    return HybridCase(attention, layout, policy, tuple(lengths), tuple(cached), tuple(tables), tuple(kept))


def _all_steps(planned):
    for grouped in planned:
        for index in range(grouped.request.num_chunks):
            yield grouped, index, grouped.request.chunk(index), grouped.step_tables(index)


@given(hybrid_cases())
def test_no_step_reads_a_column_outside_its_window(case):
    """A chunked step's read table maps exactly the columns ``[window_floor(start), end)`` covers; filler elsewhere."""
    note(repr(case))
    for grouped, _, chunk, tables in _all_steps(case.prepare()):
        for g, (group, step) in enumerate(zip(case.attention.groups, tables)):
            if step.read is None:
                continue
            bs = group.block_size
            for b, row in enumerate(grouped.request.source_rows):
                floor = case.kept[g][row].start
                assert step.read_from[b] == floor
                read = read_columns(chunk.start, min(chunk.end, case.lengths[row]), floor, group.window, bs)
                table = case.tables[g][row]
                expected = [table[j] if j in read else 0 for j in range(len(step.read[b]))]
                assert list(step.read[b]) == expected
                assert all(j in case.kept[g][row] for j in read)


@given(hybrid_cases())
def test_no_step_writes_outside_its_own_positions_and_every_owed_block_is_written_once(case):
    """Fill tables hold only blocks of the step's own positions; over a row's steps, exactly its written columns."""
    written: dict[tuple[int, int], list[int]] = {}
    for grouped, _, chunk, tables in _all_steps(case.prepare()):
        for g, (group, step) in enumerate(zip(case.attention.groups, tables)):
            bs = group.block_size
            for b, row in enumerate(grouped.request.source_rows):
                for j, block in enumerate(step.fill[b]):
                    if block < 0:
                        continue
                    column = chunk.start // bs + j
                    assert chunk.start <= column * bs + bs - 1 and column * bs < chunk.end
                    assert block == case.tables[g][row][column]
                    written.setdefault((g, row), []).append(column)
            assert all(all(b < 0 for b in fill) for fill in step.fill[len(grouped.request.source_rows) :])
    for g, group in enumerate(case.attention.groups):
        for row, (n, c) in enumerate(zip(case.lengths, case.cached)):
            assert written.get((g, row), []) == list(written_columns(n, c, group.block_size))


@given(hybrid_cases(), st.randoms(use_true_random=False))
def test_tables_differing_only_outside_the_windows_plan_to_equal_values(case, rnd):
    """Whatever lies outside the kept columns (null, stale ids, another request's blocks), the plan is equal."""
    others = [b for rows in case.tables for row in rows for b in row if b not in (NULL,)]
    changed = tuple(
        tuple(
            tuple(b if j in kept else rnd.choice([NULL, *others, FOREIGN + 7]) for j, b in enumerate(row))
            for row, kept in zip(rows, spans)
        )
        for rows, spans in zip(case.tables, case.kept)
    )
    note(repr(changed))
    planned, again = case.prepare(), case.prepare(changed)
    assert planned == again
    for grouped in planned:
        for rows, spans in zip(grouped.group_rows, case.kept):
            for row, source in zip(rows, grouped.request.source_rows):
                assert all(b == OUTSIDE for b in row[: spans[source].start])


@given(hybrid_cases())
def test_no_junk_entry_reaches_any_staged_table(case):
    """Null and stale ids never appear in a fill or read table: only the row's real blocks, -1 and the filler 0."""
    real = {b for rows in case.tables for row in rows for b in row if NULL < b < FOREIGN}
    for _, _, _, tables in _all_steps(case.prepare()):
        for step in tables:
            for row in step.fill + (step.read or ()):
                assert set(row) <= real | {-1, 0}


@given(hybrid_cases())
def test_group_signatures_name_windows_and_widths(case):
    """Each signature has one entry per group (kind, window, block size, widths) and round-trips."""
    for grouped in case.prepare():
        groups = grouped.prepared.program_signature.groups
        assert [(g.kind, g.window, g.block_size) for g in groups] == [
            (k.kind.value, k.window, k.block_size) for k in case.attention.groups
        ]
        trace = grouped.prepared.trace_signature
        if trace is not None:
            assert trace.groups == groups and from_json(PrefillTraceSignature, to_json(trace)) == trace


def _one_row(attention, bs, length, cached, window_tables):
    layout = PageTableLayout(bs, 64, 500)
    policy = PrefillPolicy(length_ladder=(64,), max_chunk_length=64, chunk_quantum=64)
    tables = tuple((t,) for t in window_tables)
    batch = PrefillBatch((length,), (cached,), (0,), tables[0], (None,))
    return prepare_grouped(batch, policy, layout, attention, tables, null_block=NULL)


def test_chunked_rows_at_different_cached_offsets_share_one_trace():
    """Rows of one chunk length at cached 64 and 192 (different first kept columns) have one trace signature."""
    attention = AttentionLayout.from_layer_types(
        ["sliding_attention", "full_attention"], sliding_window=40, block_size=16
    )
    sigs = set()
    for cached in (64, 192):
        n = cached + 50
        need = ceil_div(n, 16)
        sliding = tuple(NULL if j < (cached - 39) // 16 else 100 + j for j in range(need))
        full = tuple(300 + j for j in range(need))
        (grouped,) = _one_row(attention, 16, n, cached, (sliding, full))
        sigs.add(grouped.prepared.trace_signature)
    assert len(sigs) == 1


def test_a_null_block_inside_the_window_is_a_named_error():
    """The hit rule: every block inside the window is mapped; the first column holding the null block is named."""
    attention = AttentionLayout.from_layer_types(["sliding_attention"], sliding_window=40, block_size=16)
    table = (NULL, NULL, 7, 8, 9, 10)  # cached 64: the window needs columns 1.. (positions 25..63)
    with pytest.raises(WindowTableError) as raised:
        _one_row(attention, 16, 90, 64, (table,))
    assert raised.value.row == 0 and raised.value.field == "group_blocks[0][1]"
    (grouped,) = _one_row(attention, 16, 90, 64, ((NULL, 6, 7, 8, 9, 10),))
    assert grouped.group_rows[0][0][:1] == (OUTSIDE,)


def test_repeats_and_two_writers_count_only_inside_the_window():
    """The null block repeats freely outside the window; a repeat inside it, or one block written twice, is refused."""
    attention = AttentionLayout.from_layer_types(
        ["sliding_attention", "full_attention"], sliding_window=17, block_size=16
    )
    full = tuple(range(200, 206))
    _one_row(attention, 16, 90, 64, ((NULL, NULL, NULL, 8, 9, 10), full))
    with pytest.raises(RepeatedBlockError):
        _one_row(attention, 16, 90, 64, ((NULL, NULL, NULL, 8, 9, 8), full))
    with pytest.raises(BlockConflictError) as raised:
        _one_row(attention, 16, 90, 64, ((NULL, NULL, NULL, 8, 9, 10), (200, 201, 202, 203, 204, 10)))
    assert "one block takes one writer" in str(raised.value)


@given(st.lists(st.booleans(), min_size=1, max_size=24), st.sampled_from((1, 5, 16, 17, 40, 100)), st.integers(1, 40))
def test_every_hit_vllms_rule_returns_plans_and_reads_no_null_block(cached_flags, window, extra):
    """The table of vLLM's ``find_longest_cache_hit`` (null before the window) plans; no step reads a null."""
    bs = 16
    hit = longest_sliding_hit(cached_flags, window, bs)
    length = hit * bs + extra
    table = sliding_table_after_hit(hit, ceil_div(length, bs), window, bs, null_block=NULL, first_id=1)
    attention = AttentionLayout.from_layer_types(["sliding_attention"], sliding_window=window, block_size=bs)
    (grouped,) = _one_row(attention, bs, length, hit * bs, (table,))
    for index in range(grouped.request.num_chunks):
        (step,) = grouped.step_tables(index)
        assert NULL not in [b for b in step.fill[0] if b >= 0]
        chunk = grouped.request.chunk(index)
        read = range(window_floor(chunk.start, window) // bs, ceil_div(min(chunk.end, length), bs))
        assert step.read is None or all(step.read[0][j] != NULL for j in read)


@given(hybrid_cases())
def test_the_hybrid_manifest_covers_every_grouped_request(case):
    """``manifest_for(attention=)`` lists every program and trace ``prepare_grouped`` plans (warm-up is complete)."""
    manifest = manifest_for(case.policy, case.layout, attention=case.attention)
    for grouped in case.prepare():
        assert manifest.covers(grouped.prepared), grouped.prepared.program_signature
