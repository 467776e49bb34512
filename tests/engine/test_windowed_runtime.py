"""A hybrid model through the runtime, eager and traced: per-group tables staged, refreshed and replayed.

``HybridLlama`` (the reference Llama with transformers' ``MinistralForCausalLM``
layer types: sliding, full, sliding) runs a call of two rows twice, as vLLM
would send them: a first call computes each row's prefix, the caller frees
what left the window (NaN in those blocks, the null block or the other row's
ids in the table), and a second call computes the rest from unaligned cached
offsets. Eager and traced (a CPU replay of captured bodies over persistent
inputs refreshed in place) must both equal transformers within 1e-4, keep the
NaN null block byte-identical, and report every group's written blocks when a
step fails.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillInputError, WarmupManifest, WindowTableError
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference.windows.hybrid import HybridLlama
from tests import window_kit as kit
from tests.helpers import build_runtime
from tests.reference.windows.test_windowed import check_in_window_kv

pytest.importorskip("transformers")

LENGTHS, CACHED = (tuple(n for n, _ in kit.ROWS), tuple(c for _, c in kit.ROWS))

WINDOW = 24
LAYOUT = PageTableLayout(16, 32, 200)


def _table(rows) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)


def _setup():
    base, hf, types = kit.model_and_oracle("ministral", WINDOW)
    attention = kit.attention_of(types, WINDOW, 8)
    model = HybridLlama(base, attention)
    kv = model.new_kv_cache(LAYOUT.num_blocks)
    for pool in kv.pools:
        for tensor in pool.keys + pool.values:
            tensor[kit.NULL] = float("nan")
    runtime = build_runtime(model, kv=kv, layout=LAYOUT, policy=kit.POLICY)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, base.spec.vocab_size, (n,), generator=gen) for n in LENGTHS]
    tokens = torch.zeros(2, max(LENGTHS), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return runtime, kv, attention, hf, prompts, tokens


def _calls(kv, attention):
    """The two calls' ``(lengths, cached, group tables)``; the second after freeing what left the windows."""
    tables = kit.fresh_tables(attention, LENGTHS)
    yield list(CACHED), [0, 0], tables
    rows = [
        kit.free_left_window(kv, attention, [t[0] for t in tables], [t[1] for t in tables], CACHED[0], "null"),
        kit.free_left_window(kv, attention, [t[1] for t in tables], [t[0] for t in tables], CACHED[1], "other"),
    ]
    yield list(LENGTHS), list(CACHED), tuple(tuple(r[g] for r in rows) for g in range(len(attention.groups)))


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_a_hybrid_call_through_the_runtime_equals_transformers(mode):
    """Both rows' logits and in-window KV equal transformers; the NaN null block is never changed."""
    runtime, kv, attention, hf, prompts, tokens = _setup()
    executor = PrefillExecutor(runtime)
    null_bytes = kv.block_bytes(kit.NULL)
    for lengths, cached, tables in _calls(kv, attention):
        page_tables = [_table(t) for t in tables]
        batch = runtime.prepare(tokens, page_tables[0], lengths, cached, group_page_tables=page_tables, null_block=0)
        if mode == "traced":
            executor.warm_up(WarmupManifest().observe(batch.requests))
            assert runtime.captured_traces()
        results = runtime.assemble(executor.invocations(batch, mode), batch.num_rows)
        assert torch.equal(kv.block_bytes(kit.NULL), null_bytes)
    for row, result in enumerate(results):
        expected, hf_kv = kit.hf_logits_and_kv(hf, prompts[row])
        assert torch.allclose(result.logits, expected, rtol=kit.TOL, atol=kit.TOL), (
            row,
            (result.logits - expected).abs().max(),
        )
        check_in_window_kv(kv, [t[row] for t in tables], hf_kv, LENGTHS[row], WINDOW)
    executor.close()


def test_a_hybrid_call_names_a_null_block_inside_a_window_and_writes_nothing():
    """A table whose window holds the null block is a ``WindowTableError`` before any step; no table at all too."""
    runtime, kv, attention, _, _, tokens = _setup()
    tables = kit.fresh_tables(attention, LENGTHS)
    broken = [list(map(list, t)) for t in tables]
    broken[0][0][5] = kit.NULL  # row 0 cached 70: window 24 keeps the sliding group's columns from 5 on (block 8)
    before = [kv.block_bytes(b) for b in range(LAYOUT.num_blocks)]
    page_tables = [_table(t) for t in broken]
    with pytest.raises(WindowTableError) as raised:
        runtime.prepare(
            tokens, page_tables[0], list(LENGTHS), list(CACHED), group_page_tables=page_tables, null_block=0
        )
    assert raised.value.row == 0 and raised.value.field == "group_blocks[0][5]"
    with pytest.raises(PrefillInputError, match="group_page_tables"):
        runtime.prepare(tokens, page_tables[0], list(LENGTHS), list(CACHED))
    assert all(torch.equal(kv.block_bytes(b), old) for b, old in enumerate(before))


class _FailingSecondStep:
    """Delegates to a hybrid model; its second ``forward_grouped`` raises (a device fault mid-request)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.spec, self.dtype, self.attention = inner.spec, inner.dtype, inner.attention

    def forward_hidden(self, *args):
        return self.inner.forward_hidden(*args)

    def forward_grouped(self, *args):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected fault in step 2")
        return self.inner.forward_grouped(*args)

    def lm_head(self, rows):
        return self.inner.lm_head(rows)


def test_a_failed_hybrid_step_reports_every_groups_blocks_as_partial_writes():
    """A fault in a chunked row's second step names the blocks both started steps write, in every KV group."""
    runtime, kv, attention, _, _, tokens = _setup()
    model = _FailingSecondStep(runtime.config.model)
    runtime = build_runtime(model, kv=kv, layout=LAYOUT, policy=kit.POLICY)
    tables = kit.fresh_tables(attention, (150,))
    page_tables = [_table(t) for t in tables]
    batch = runtime.prepare(tokens[:1], page_tables[0], [150], [0], group_page_tables=page_tables, null_block=0)
    with pytest.raises(RuntimeError, match="injected") as raised:
        runtime.assemble(PrefillExecutor(runtime).invocations(batch, "eager"), batch.num_rows)
    written = set(raised.value.partial_writes[0])
    expected = set()
    for table, group in zip(tables, attention.groups):
        expected |= set(table[0][: 128 // group.block_size])  # steps 1 and 2 (64 positions each) started
    assert written == expected
