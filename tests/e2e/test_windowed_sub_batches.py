"""More rows than a lane's slots, without slots, on a windowed model: sub-batches of ``lane_size`` rows.

A caller that names no slots (``runtime.prefill`` without ``slots``) may send
any number of rows; the core splits padded waves into sub-batches of
``lane_size`` consecutive rows (``prefill_core.calls.call_plan``, rule 2) for a model
with KV groups exactly as for one without. Once, a windowed model's call
of 40 such rows was refused (``InvalidSlotError: row 32``), eager and traced.
Each row's last-token logits must equal transformers' on the same weights.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PlanKind, PrefillPolicy, WarmupManifest
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference.windows.hybrid import HybridLlama
from tests import window_kit as kit
from tests.engine.test_windowed_runtime import _table
from tests.helpers import build_runtime

pytest.importorskip("transformers")

WINDOW, ROWS = 24, 40
POLICY = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4, 8), lane_size=8)


@pytest.mark.parametrize("mode", ["packed", "eager", "traced"])
def test_forty_unslotted_rows_on_a_windowed_model_equal_transformers(mode):
    """40 rows of 20-60 tokens on an 8-slot lane (Mistral, every layer sliding), each row equal to transformers."""
    base, hf, types = kit.model_and_oracle("mistral", WINDOW)
    attention = kit.attention_of(types, WINDOW, 16)
    model = HybridLlama(base, attention)
    layout = PageTableLayout(16, 8, 400)
    policy = attrs.evolve(POLICY, packed_steps=mode == "packed")
    runtime = build_runtime(model, kv=model.new_kv_cache(layout.num_blocks), layout=layout, policy=policy)
    gen = torch.Generator().manual_seed(3)
    lengths = [int(n) for n in torch.randint(20, 61, (ROWS,), generator=gen)]
    tokens = torch.zeros(ROWS, max(lengths), dtype=torch.int64)
    prompts = [torch.randint(0, base.spec.vocab_size, (n,), generator=gen) for n in lengths]
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    tables = [_table(t) for t in kit.fresh_tables(attention, lengths)]
    executor = PrefillExecutor(runtime)
    call = dict(group_page_tables=tables, null_block=0)
    batch = runtime.prepare(tokens, tables[0], lengths, mode="auto" if mode == "packed" else mode, **call)
    if mode == "traced":
        executor.warm_up(WarmupManifest().observe(batch.requests))
    expected_kind = PlanKind.GROUPED_PACKED if mode == "packed" else PlanKind.GROUPED
    assert batch.plan.kind is expected_kind
    if mode != "packed":
        assert max(p.request.active_batch_size for p in batch.requests) <= policy.lane_size
    results = executor.prefill(tokens, tables[0], lengths, mode="eager" if mode == "packed" else mode, **call)
    assert [r.row for r in results] == list(range(ROWS))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf(prompt[None]).logits[0, -1]
        torch.testing.assert_close(results[row].logits, want, atol=kit.TOL, rtol=kit.TOL)
