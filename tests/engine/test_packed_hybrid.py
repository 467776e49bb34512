"""Packed steps of a hybrid model through the runtime: what a failed step reports, and when a call is not packed.

Oracles for packed hybrid steps are in ``test_window_matrix`` (one row beside another live request) and
``test_gemma3_runtime`` (two rows sharing steps); here: partial writes name every KV group's blocks of the
started packed steps, and a call where one row reads a block another row writes is planned as padded waves
(which order the two), still equal to transformers.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import RequestKind
from prefill_shell.backends.torch_backend import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference.windows.hybrid import HybridLlama
from tests import window_kit as kit
from tests.engine.test_windowed_runtime import LAYOUT, WINDOW, _FailingSecondStep, _table

pytest.importorskip("transformers")

PACKED = attrs.evolve(kit.POLICY, packed_steps=True)


class _FailingSecondPackedStep(_FailingSecondStep):
    """``_FailingSecondStep`` for packed steps: its second ``forward_packed_grouped`` raises."""

    packed_steps = True

    def forward_packed_grouped(self, *args):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected fault in packed step 2")
        return self.inner.forward_packed_grouped(*args)


def _runtime(model, kv):
    return PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(), kv, LAYOUT, PACKED))


def test_a_failed_packed_hybrid_step_reports_every_groups_blocks_as_partial_writes():
    """A fault in a 150-token row's second packed step (64 positions each) names both steps' blocks in every group."""
    base, _, types = kit.model_and_oracle("ministral", WINDOW)
    attention = kit.attention_of(types, WINDOW, 8)
    kv = HybridLlama(base, attention).new_kv_cache(LAYOUT.num_blocks)
    runtime = _runtime(_FailingSecondPackedStep(HybridLlama(base, attention)), kv)
    tables = kit.fresh_tables(attention, (150,))
    page_tables = [_table(t) for t in tables]
    tokens = torch.randint(0, base.spec.vocab_size, (1, 150), generator=torch.Generator().manual_seed(4))
    batch = runtime.prepare(tokens, page_tables[0], [150], [0], group_page_tables=page_tables, null_block=0)
    assert [p.request.kind for p in batch.requests] == [RequestKind.PACKED]
    with pytest.raises(RuntimeError, match="injected") as raised:
        runtime.assemble(PrefillExecutor(runtime).invocations(batch, "eager"), batch.num_rows)
    expected = set()
    for table, group in zip(tables, attention.groups):
        expected |= set(table[0][: 128 // group.block_size])
    assert set(raised.value.partial_writes[0]) == expected


def test_a_call_where_a_row_reads_another_rows_writes_runs_padded_and_equals_transformers():
    """Row 1 shares row 0's first block in every group (a same-call prefix hit): padded waves, both rows exact."""
    base, hf, types = kit.model_and_oracle("ministral", WINDOW)
    attention = kit.attention_of(types, WINDOW, 16)
    model = HybridLlama(base, attention)
    kv = model.new_kv_cache(LAYOUT.num_blocks)
    runtime = _runtime(model, kv)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, base.spec.vocab_size, (16,), generator=gen)
    prompts = [torch.cat((shared, torch.randint(0, base.spec.vocab_size, (n,), generator=gen))) for n in (40, 60)]
    tokens = torch.zeros(2, 76, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    tables = [((1, 2, 3, 4, 5), (1, 6, 7, 8, 9))] * len(attention.groups)
    tables = [tuple(tuple(b + 20 * g for b in row) for row in t) for g, t in enumerate(tables)]
    page_tables = [_table(t) for t in tables]
    batch = runtime.prepare(tokens, page_tables[0], [56, 76], [0, 16], group_page_tables=page_tables, null_block=0)
    assert RequestKind.PACKED not in {p.request.kind for p in batch.requests}
    results = runtime.assemble(PrefillExecutor(runtime).invocations(batch, "eager"), batch.num_rows)
    for result, prompt in zip(results, prompts):
        expected, _ = kit.hf_logits_and_kv(hf, prompt)
        assert torch.allclose(result.logits, expected, rtol=kit.TOL, atol=kit.TOL), (result.logits - expected).abs()
