"""Prompt log-probs equal transformers' log_softmax gathered at the next token: padded (eager, traced) and packed."""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, RequestKind, SamplingParams
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.engine.steps.prompt_logprobs import POSITIONS_PER_CALL
from tests.helpers import build_runtime

SMALL_CHUNKS = PrefillPolicy(max_chunk_length=256, chunk_quantum=128, length_ladder=(128, 256))
"""256-token chunks: a 300-token row runs in two steps, so requested ranges cross a chunk boundary."""

TOP_N = 3


def _runtime(model, block_size: int, *, packed: bool = False) -> PrefillRuntime:
    layout = PageTableLayout(block_size, 512 // block_size, 2048 // block_size)
    return build_runtime(model, layout=layout, policy=attrs.evolve(SMALL_CHUNKS, packed_steps=packed))


def _run(runtime: PrefillRuntime, tokens, table, lengths, cached, sampling, traced: bool):
    mode = "traced" if traced else "eager"
    batch = runtime.prepare(tokens, table, lengths, cached, sampling=sampling, mode=mode)
    if traced:
        for prepared in batch.requests:
            runtime.capture(prepared.trace_signature)
            runtime.allocate_workspace(prepared.program_signature)
    return runtime.assemble(runtime.invocations(batch, mode=mode), batch.num_rows)


def _expected(hf, row: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(row[None]).logits[0].float(), dim=-1)  # [len, V]


def _check_row(result, row: torch.Tensor, start: int, expected: torch.Tensor, top_n: int) -> None:
    entries = result.prompt_logprobs
    assert [e.position for e in entries] == list(range(start + 1, len(row)))
    for e in entries:
        want = expected[e.position - 1]
        assert e.token == int(row[e.position])
        assert abs(e.logprob - want[e.token].item()) <= 1e-4, (e.position, e.logprob, want[e.token].item())
        assert len(e.top) == top_n
        best = torch.topk(want, top_n)
        for (token, value), want_value in zip(e.top, best.values.tolist()):
            assert abs(value - want_value) <= 1e-4 and abs(want[token].item() - value) <= 1e-4


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_uncached_and_cached_rows_match_transformers(tiny_model, oracle, kit, block_size, traced):
    """Uncached rows (one and two chunks) and a cached row with a later start: every requested position within 1e-4."""
    rows = [kit.make_tokens(n, seed) for n, seed in ((300, 1), (130, 2), (300, 3))]
    runtime = _runtime(tiny_model, block_size)
    blocks = kit.assign_blocks([len(r) for r in rows], block_size, runtime.config.layout.num_blocks, 7)
    table = kit.page_table(blocks)
    tokens = kit.token_matrix(rows)
    # Row 2's first 128 tokens go in first (a cached prefix), then row 2 runs with them cached.
    _run(runtime, tokens[2:, :128], table[2:], [128], [0], None, traced=False)
    starts = (0, 5, 200)
    sampling = [SamplingParams.greedy(prompt_logprobs=TOP_N, prompt_start=s) for s in starts]
    results = _run(runtime, tokens, table, [len(r) for r in rows], [0, 0, 128], sampling, traced)
    for result, row, start in zip(results, rows, starts):
        expected = _expected(oracle.hf, row)
        _check_row(result, row, start, expected, TOP_N)
        assert result.token == int(expected[-1].argmax())  # the last-token output is unchanged
    assert runtime.backend.ledger.live() == [] or traced


def test_default_start_is_the_cached_offset_and_rows_without_a_request_get_none(tiny_model, oracle, kit):
    """In one wave: prompt_start None scores from the cached offset; a row that asks for nothing gets ()."""
    rows = [kit.make_tokens(n, seed) for n, seed in ((96, 4), (96, 5))]
    runtime = _runtime(tiny_model, 32)
    table = kit.page_table(kit.assign_blocks([96, 96], 32, runtime.config.layout.num_blocks, 3))
    sampling = [SamplingParams.greedy(prompt_logprobs=0), SamplingParams.greedy()]
    (wave,) = runtime.prepare(kit.token_matrix(rows), table, [96, 96], [0, 0], sampling=sampling).requests
    assert wave.request.active_batch_size == 2 and wave.program_signature.prompt_logprobs  # one wave, both rows
    results = _run(runtime, kit.token_matrix(rows), table, [96, 96], [0, 0], sampling, False)
    _check_row(results[0], rows[0], 0, _expected(oracle.hf, rows[0]), 0)
    assert results[1].prompt_logprobs == ()


def test_transient_logits_stay_one_piece_at_a_time(tiny_model, kit, monkeypatch):
    """The LM head never sees more than POSITIONS_PER_CALL rows, however long the prompt."""
    seen = []
    runtime = _runtime(tiny_model, 32)
    original = runtime._run_lm_head
    monkeypatch.setattr(runtime, "_run_lm_head", lambda rows: seen.append(rows.shape[0]) or original(rows))
    runtime._prompt._lm_head = runtime._run_lm_head
    row = kit.make_tokens(300, 9)
    table = kit.page_table(kit.assign_blocks([300], 32, runtime.config.layout.num_blocks, 1))
    (result,) = _run(runtime, row[None], table, [300], [0], [SamplingParams.greedy(prompt_logprobs=0)], False)
    assert len(result.prompt_logprobs) == 299
    assert max(seen) == POSITIONS_PER_CALL and sum(seen) == 299  # the prompt pieces (the last token has its own head)
    assert runtime.backend.ledger.live() == []


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_packed_steps_match_the_padded_path_and_transformers(tiny_model, oracle, kit, block_size):
    """Packed steps (rows split across steps and requests), uncached and cached: equal to padded and transformers."""
    rows = [kit.make_tokens(n, seed) for n, seed in ((300, 1), (130, 2), (300, 3), (block_size + 9, 4))]
    lengths, cached = [len(r) for r in rows], [0, 0, 128, block_size]
    starts = (0, 5, 200, block_size)
    sampling = [SamplingParams.greedy(prompt_logprobs=TOP_N, prompt_start=s) for s in starts]
    results = {}
    for packed in (False, True):
        runtime = _runtime(tiny_model, block_size, packed=packed)
        blocks = kit.assign_blocks(lengths, block_size, runtime.config.layout.num_blocks, 7)
        table, tokens = kit.page_table(blocks), kit.token_matrix(rows)
        for r in (2, 3):  # the cached prefixes go in first
            _run(runtime, tokens[r : r + 1, : cached[r]], table[r : r + 1], [cached[r]], [0], None, traced=False)
        batch = runtime.prepare(tokens, table, lengths, cached, sampling=sampling)
        kinds = {p.request.kind is RequestKind.PACKED for p in batch.requests}
        assert kinds == {packed}
        if packed:  # row 2 starts in the first request's last step and ends in a later request
            assert any(2 not in p.request.source_rows for p in batch.requests if 2 in _segment_rows(p.request))
        results[packed] = runtime.assemble(runtime.invocations(batch), batch.num_rows)
        assert runtime.backend.ledger.live() == []
    for padded, packed, row, start in zip(results[False], results[True], rows, starts):
        _check_row(packed, row, start, _expected(oracle.hf, row), TOP_N)
        assert [e.token for e in packed.prompt_logprobs] == [e.token for e in padded.prompt_logprobs]
        for a, b in zip(packed.prompt_logprobs, padded.prompt_logprobs):
            assert abs(a.logprob - b.logprob) <= 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert packed.token == padded.token


def _segment_rows(request) -> set[int]:
    return {segment.row for step in request.steps for segment in step.segments}


def test_each_row_gets_its_own_number_of_alternatives(tiny_model, oracle, kit):
    """Rows of one step asking for 0, 1 and 4 alternatives get exactly that many, packed and padded."""
    rows = [kit.make_tokens(n, seed) for n, seed in ((70, 11), (50, 12), (90, 13))]
    sampling = [SamplingParams.greedy(prompt_logprobs=n) for n in (0, 1, 4)]
    for packed in (False, True):
        runtime = _runtime(tiny_model, 32, packed=packed)
        table = kit.page_table(kit.assign_blocks([70, 50, 90], 32, runtime.config.layout.num_blocks, 5))
        results = _run(runtime, kit.token_matrix(rows), table, [70, 50, 90], [0, 0, 0], sampling, False)
        for result, row, n in zip(results, rows, (0, 1, 4)):
            _check_row(result, row, 0, _expected(oracle.hf, row), n)
