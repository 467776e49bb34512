"""Prompt log-probs equal transformers' log_softmax gathered at the next token, eager and traced, cached or not."""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams
from prefill_shell.backends import TorchBackend
from prefill_shell.config import PrefillRuntimeConfig
from prefill_shell.prompt_logprobs import POSITIONS_PER_CALL
from prefill_shell.runtime import PrefillRuntime

SMALL_CHUNKS = PrefillPolicy(max_chunk_length=256, chunk_quantum=128, length_ladder=(128, 256))
"""256-token chunks: a 300-token row runs in two steps, so requested ranges cross a chunk boundary."""

TOP_N = 3


def _runtime(model, block_size: int) -> PrefillRuntime:
    layout = PageTableLayout(block_size, 512 // block_size, 2048 // block_size)
    kv = model.new_kv_cache(layout.num_blocks, layout.block_size)
    config = PrefillRuntimeConfig.resolve(model, TorchBackend(), kv, layout=layout, policy=SMALL_CHUNKS)
    return PrefillRuntime(config)


def _run(runtime: PrefillRuntime, tokens, table, lengths, cached, sampling, traced: bool):
    batch = runtime.prepare(tokens, table, lengths, cached, sampling=sampling)
    if traced:
        for prepared in batch.requests:
            runtime.capture(prepared.trace_signature)
            runtime.allocate_workspace(prepared.program_signature)
    return runtime.assemble(runtime.invocations(batch, traced=traced), batch.num_rows)


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
