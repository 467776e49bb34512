"""Shared spans (planning/shared_spans.py, packed.py rule 6): rows that begin alike compute those positions once.

The properties check a packed plan against the rows' tokens themselves (``ListAgreement`` reads them), so a
shared write whose source holds other tokens, or a position neither computed nor written, fails here.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from hypothesis import given
from hypothesis import strategies as st

from prefill_core import (
    CallContext,
    PageTableLayout,
    PlanKind,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    SamplingParams,
    TokenAgreement,
    plan_call,
    plan_packed,
)
from prefill_core.values.execution import ExecutionMode
from prefill_core.values.intmath import ceil_div

BS = 16


class ListAgreement:
    """``TokenAgreement`` over token lists, written apart from the shell's torch one."""

    def __init__(self, tokens: Sequence[Sequence[int]]):
        self.tokens = [list(t) for t in tokens]
        self.asked: list[tuple[int, tuple[int, ...], int]] = []

    def agreement(self, row, others, start):
        self.asked.append((row, tuple(others), start))
        mine, counts = self.tokens[row], []
        for other in others:
            theirs, n = self.tokens[other], 0
            while start + n < min(len(mine), len(theirs)) and mine[start + n] == theirs[start + n]:
                n += 1
            counts.append(n)
        return counts


@attrs.frozen
class SharedCase:
    tokens: tuple[tuple[int, ...], ...]
    batch: PrefillBatch
    layout: PageTableLayout
    policy: PrefillPolicy
    read_from: dict

    def agree(self, a: int, b: int, start: int) -> int:
        return ListAgreement(self.tokens).agreement(a, [b], start)[0]


@st.composite
def shared_cases(draw) -> SharedCase:
    """2-7 rows that often begin alike: a common stem cut at random, then short random tails over a 2-letter
    alphabet (so tails agree too); some rows read one cached prefix through the same blocks, others own
    theirs; a few rows ask for logits, a few read hidden states from some position on."""
    size = draw(st.integers(0, 70))
    stem = draw(st.lists(st.integers(1, 2), min_size=size, max_size=size))
    rows = draw(st.integers(2, 7))
    tokens = []
    for _ in range(rows):
        cut = draw(st.one_of(st.just(len(stem)), st.integers(0, len(stem))))
        tail = draw(st.lists(st.integers(1, 2), min_size=0 if cut else 1, max_size=30))
        tokens.append(tuple(stem[:cut]) + tuple(tail))
    # Rows whose first ``shared`` tokens are the stem's may read them as one cached prefix (the same blocks).
    shared = BS * draw(st.integers(0, len(stem) // BS))
    readers = [i for i, t in enumerate(tokens) if shared and len(t) >= shared and t[:shared] == tuple(stem[:shared])]
    readers = [i for i in readers if draw(st.sampled_from([True, True, False]))] if len(readers) > 1 else []
    prefix = tuple(range(shared // BS)) if readers else ()
    next_block, built, writers = len(prefix), [], []
    for i, t in enumerate(tokens):
        sampling = draw(st.sampled_from([SamplingParams.greedy(), SamplingParams.greedy(), None]))
        long_writers = [j for j in writers if built[j].length >= BS]
        if i in readers:
            cached = shared
            blocks = prefix + tuple(range(next_block, next_block + ceil_div(len(t), BS) - shared // BS))
        elif long_writers and draw(st.integers(0, 2)) == 0:
            # A same-step prefix hit: the row reads an earlier row's first k blocks, which that row writes in
            # this call, as its cached prefix (vLLM's scheduler caches a block as soon as it is allocated).
            writer = built[draw(st.sampled_from(long_writers))]
            cached = BS * draw(st.integers(1, writer.length // BS))
            t = tokens[writer.slot][:cached] + (t[cached:] or (1,))
            tokens[i] = t
            blocks = writer.blocks[: cached // BS]
            blocks += tuple(range(next_block, next_block + ceil_div(len(t), BS) - cached // BS))
            sampling = writer.sampling  # one kind: a reader of the other kind's blocks may be a named cycle
        else:
            cached = draw(st.sampled_from([0, 0, 0, BS * (len(t) // BS // 2), len(t) // 2]))
            blocks = tuple(range(next_block, next_block + ceil_div(len(t), BS)))
            if cached == 0:
                writers.append(i)
        next_block = max([next_block, *(b + 1 for b in blocks)])
        built.append(PrefillRow(len(t), cached, i, blocks, sampling))
    read_from = {i: draw(st.integers(0, len(t))) for i, t in enumerate(tokens) if draw(st.integers(0, 4)) == 0}
    budget = draw(st.sampled_from([32, 64, 2048]))
    policy = attrs.evolve(PrefillPolicy(), max_chunk_length=budget, lane_size=8)
    return SharedCase(
        tuple(tokens), PrefillBatch.from_rows(built), PageTableLayout(BS, 16, next_block), policy, read_from
    )


def _plan(case: SharedCase, agreement: TokenAgreement | None = None):
    agreement = ListAgreement(case.tokens) if agreement is None else agreement
    return plan_packed(case.batch, case.policy, case.layout, agreement=agreement, read_from=case.read_from)


def _steps(requests):
    return [step for request in requests for step in request.steps]


def _peer(case: SharedCase, q: int, row: int) -> bool:
    """Rule 1: ``q`` may give ``row`` positions (their K/V before ``row``'s cached length is one memory)."""
    b, cached = case.batch, case.batch.cached[row]
    return (
        b.cached[q] <= cached
        and b.cached[q] < b.lengths[q]
        and b.blocks[q][: cached // BS] == b.blocks[row][: cached // BS]
        and (b.sampling[q] is None) == (b.sampling[row] is None)
    )


@given(shared_cases())
def test_each_owed_position_is_computed_or_written_once_and_every_row_computes_its_last_token(case):
    """Per row, its segments and the shared writes into it tile what it owes, [cached, length), once; the last
    token and every position from ``read_from`` on are computed (rule 3)."""
    computed: dict[int, list[tuple[int, int]]] = {}
    written: dict[int, list[tuple[int, int]]] = {}
    for step in _steps(_plan(case)):
        for s in step.segments:
            computed.setdefault(s.row, []).append((s.start, s.end))
        for w in step.shared:
            written.setdefault(w.row, []).append((w.start, w.end))
    for row, (length, cached) in enumerate(zip(case.batch.lengths, case.batch.cached)):
        own = sorted(computed[row])
        if cached == length:
            assert own == [(length - 1, length)] and row not in written
            continue
        spans = sorted(written.get(row, []) + own)
        assert spans[0][0] == cached and spans[-1][1] == length, (row, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"row {row}: gaps or overlaps {spans}"
        first_computed = own[0][0]
        assert first_computed <= max(cached, min(length - 1, case.read_from.get(row, length)))
        assert all(end <= first_computed for _, end in written.get(row, []))


@given(shared_cases())
def test_a_shared_write_comes_from_a_row_with_the_same_cache_and_tokens_computing_it_in_that_step(case):
    """The source holds the taker's tokens from position 0 to the write's end, and computes those positions in
    the step holding the write (rules 1, 2 and 4); the taker's cached prefix is block aligned."""
    for step in _steps(_plan(case)):
        for w in step.shared:
            assert w.source != w.row and case.batch.cached[w.row] % BS == 0
            assert case.tokens[w.source][: w.end] == case.tokens[w.row][: w.end]
            assert (case.batch.sampling[w.source] is None) == (case.batch.sampling[w.row] is None)
            assert any(s.row == w.source and s.start <= w.start and w.end <= s.end for s in step.segments)


@given(shared_cases())
def test_a_takers_first_segment_comes_no_earlier_than_the_step_of_each_write_into_it(case):
    """Rule 4: when a row first computes, every shared write into it has happened (same step or before)."""
    first_step: dict[int, int] = {}
    writes: dict[int, list[int]] = {}
    for index, step in enumerate(_steps(_plan(case))):
        for s in step.segments:
            first_step.setdefault(s.row, index)
        for w in step.shared:
            writes.setdefault(w.row, []).append(index)
    for row, indices in writes.items():
        assert max(indices) <= first_step[row]


@given(shared_cases())
def test_no_row_computes_a_position_an_earlier_row_with_its_cache_already_holds(case):
    """Rule 2 is kept to the full: a row's first computed position is where its agreement with every row packed
    before it (same kind, same cached blocks) ends, unless its last token or ``read_from`` stops it first."""
    requests = _plan(case)
    order: list[int] = []
    first: dict[int, int] = {}
    for step in _steps(requests):
        for s in step.segments:
            if s.row not in first:
                order.append(s.row)
                first[s.row] = s.start
    for position, row in enumerate(order):
        length, cached = case.batch.lengths[row], case.batch.cached[row]
        if cached == length or cached % BS:
            assert first[row] == (length - 1 if cached == length else cached)
            continue
        earlier = [q for q in order[:position] if _peer(case, q, row)]
        reach = max((case.agree(row, q, cached) for q in earlier), default=0)
        assert first[row] == max(cached, min(cached + reach, length - 1, case.read_from.get(row, length)))


@given(shared_cases())
def test_written_blocks_name_each_shared_writes_blocks_and_computed_tokens_drop_by_what_is_shared(case):
    """``written_blocks`` covers the blocks a shared write fills (partial writes name them); the plan computes
    exactly the owed positions less the shared ones."""
    requests = _plan(case)
    shared = 0
    for request in requests:
        for index, step in enumerate(request.steps):
            blocks = request.written_blocks(index)
            for w in step.shared:
                shared += w.length
                want = case.batch.blocks[w.row][w.start // BS : ceil_div(w.end, BS)]
                assert set(want) <= set(blocks[w.row])
    owed = sum(max(n - c, 1) for n, c in zip(case.batch.lengths, case.batch.cached))
    assert sum(r.computed_tokens for r in requests) == owed - shared
    assert sum(r.real_tokens for r in requests) == owed


@given(shared_cases())
def test_without_agreement_or_with_rows_that_never_agree_the_plan_is_the_plain_one(case):
    """No agreement (a model without shared writes) and an agreement of zeros plan what plan_packed always did."""
    plain = plan_packed(case.batch, case.policy, case.layout)

    class Disagree:
        def agreement(self, row, others, start):
            return [0] * len(others)

    assert _plan(case, Disagree()) == plain
    assert all(not step.shared for step in _steps(plain))


def _chat_rows(tails: list[int]) -> tuple[list[list[int]], PrefillBatch, PageTableLayout]:
    """Rows of a 171-token system prompt (160 of it cached in blocks 0-4 of 32), then a private tail each."""
    system = [7] * 171
    tokens = [system + [100 + i] * n for i, n in enumerate(tails)]
    rows, next_block = [], 5
    for i, t in enumerate(tokens):
        own = ceil_div(len(t), 32) - 5
        rows.append(PrefillRow(len(t), 160, i, tuple(range(5)) + tuple(range(next_block, next_block + own)), None))
        next_block += own
    return tokens, PrefillBatch.from_rows(rows), PageTableLayout(32, 16, next_block)


def test_chat_rows_over_one_cached_system_prompt_compute_its_uncached_tail_once():
    """Four chat rows: the first computes the system prompt's 11 uncached tokens and its own 13; each other row
    computes only its own tail, and takes those 11 tokens' K/V from the first row's step."""
    tokens, batch, layout = _chat_rows([13, 12, 12, 20])
    (request,) = plan_packed(batch, PrefillPolicy(), layout, agreement=ListAgreement(tokens))
    (step,) = request.steps
    assert [(s.row, s.start, s.length) for s in step.segments] == [
        (0, 160, 24),
        (1, 171, 12),
        (2, 171, 12),
        (3, 171, 20),
    ]
    assert [(w.source, w.row, w.start, w.length) for w in step.shared] == [
        (0, 1, 160, 11),
        (0, 2, 160, 11),
        (0, 3, 160, 11),
    ]
    assert request.last_token_offsets == (23, 35, 47, 67)


def test_identical_prompts_compute_the_prompt_once_and_each_copy_its_last_token():
    """vLLM's n > 1 samples of one prompt arrive as identical rows: the later ones compute their last token alone."""
    tokens = [[5, 6, 7] * 30] * 3
    batch = PrefillBatch.from_rows([PrefillRow(90, 0, i, (3 * i, 3 * i + 1, 3 * i + 2)) for i in range(3)])
    (request,) = plan_packed(batch, PrefillPolicy(), PageTableLayout(32, 4, 9), agreement=ListAgreement(tokens))
    (step,) = request.steps
    assert [(s.row, s.start, s.length) for s in step.segments] == [(0, 0, 90), (1, 89, 1), (2, 89, 1)]
    assert [(w.source, w.row, w.start, w.length) for w in step.shared] == [(0, 1, 0, 89), (0, 2, 0, 89)]
    assert request.written_blocks(0) == {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7, 8)}


def test_a_source_split_over_steps_writes_each_part_in_the_step_computing_it():
    """With a 64-token budget the first row's 90 tokens span two steps; the copy into row 1 follows them."""
    tokens = [[5] * 90, [5] * 80 + [6] * 10]
    batch = PrefillBatch.from_rows([PrefillRow(90, 0, 0, (0, 1, 2)), PrefillRow(90, 0, 1, (3, 4, 5))])
    policy = attrs.evolve(PrefillPolicy(), max_chunk_length=64)
    requests = plan_packed(batch, policy, PageTableLayout(32, 4, 6), agreement=ListAgreement(tokens))
    steps = _steps(requests)
    assert [[(w.row, w.start, w.length) for w in s.shared] for s in steps] == [[(1, 0, 64)], [(1, 64, 16)]]
    assert [[(s.row, s.start, s.length) for s in step.segments] for step in steps] == [
        [(0, 0, 64)],
        [(0, 64, 26), (1, 80, 10)],
    ]


def test_rows_read_from_a_position_compute_from_there_and_other_kinds_or_caches_never_share():
    """A row with prompt log-probs from 165 computes from 165; a logits row among sampled rows, and a row over
    other cached blocks, share nothing with them."""
    tokens, batch, layout = _chat_rows([13, 12, 12, 12])
    rows = list(batch.rows)
    rows[1] = attrs.evolve(rows[1], sampling=SamplingParams.greedy())
    rows[2] = attrs.evolve(rows[2], sampling=SamplingParams.greedy())
    rows[3] = attrs.evolve(rows[3], blocks=(20, 21, 22, 23, 24) + rows[3].blocks[5:])
    layout = PageTableLayout(32, 16, 25)
    batch = PrefillBatch.from_rows(rows)
    requests = plan_packed(batch, PrefillPolicy(), layout, agreement=ListAgreement(tokens), read_from={2: 165})
    firsts = {s.row: s.start for step in _steps(requests) for s in step.segments}
    assert firsts == {0: 160, 1: 160, 2: 165, 3: 160}
    assert [(w.source, w.row, w.start, w.length) for step in _steps(requests) for w in step.shared] == [(1, 2, 160, 5)]


def test_plan_call_shares_only_where_the_context_carries_the_agreement():
    """``plan_call`` plans shared spans for a packed call whose context has an agreement, and none without one
    (a lane whose model takes no shared writes), nor in padded waves."""
    tokens, batch, layout = _chat_rows([13, 12])
    context = CallContext(PrefillPolicy(), layout, ExecutionMode.EAGER, lane_runs_packed=True)
    agreement = ListAgreement(tokens)
    shared = plan_call(batch, attrs.evolve(context, agreement=agreement))
    plain = plan_call(batch, context)
    padded = plan_call(batch, attrs.evolve(context, lane_runs_packed=False, agreement=agreement))
    assert shared.kind is PlanKind.PACKED and shared.prepared[0].request.steps[0].shared
    assert not plain.prepared[0].request.steps[0].shared
    assert padded.kind is PlanKind.PADDED
    assert agreement.asked == [(1, (0,), 160)]  # asked once, for the padded plan never
