"""A hybrid model served by a vLLM-like scheduler with prefix caching and sliding-window freeing.

Six prompts sharing a 40-token preamble run two at a time under a 40-token
budget (chunks end inside blocks) on a 40-block pool, so prefix hits map the
null block before the window, and blocks that left a request's window are
freed and handed to other requests while their ids stay in the first
request's table (``hybrid_scheduler``). Eager and traced: each request's
final logits equal transformers' one-shot prefill of its prompt within 1e-4,
no step changes a KV byte outside the blocks it writes, and stale entries
pointing at another live request's blocks did occur.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, SamplingPath, manifest_for
from prefill_core.values.computed_positions import written_columns
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference.windows.hybrid import HybridLlama
from tests.core.vllm_sliding import first_kept_after
from tests.e2e.hybrid_scheduler import HybridPool, Request, admit, finish, grow, register_full_blocks, remove_skipped
from tests.helpers import build_runtime
from tests.window_kit import NULL, attention_of, hf_logits_and_kv, model_and_oracle, nan_fill

pytest.importorskip("transformers")

TOL = 1e-4
WINDOW = 24
BUDGET, MAX_SEQS, NUM_BLOCKS = 40, 2, 40
POLICY = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2), lane_size=2)
LAYOUT = PageTableLayout(16, 16, NUM_BLOCKS)


def _prompts(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    preamble = torch.randint(0, vocab, (40,), generator=gen)
    tails = [torch.randint(0, vocab, (n,), generator=gen) for n in (30, 77, 51, 100, 64, 90)]
    return [torch.cat((preamble, tail)) for tail in tails]


def _step_call(running, plan, attention):
    width = max(len(r.tokens) for r in running)
    tokens = torch.zeros(len(running), width, dtype=torch.int64)
    tables = []
    for row, r in enumerate(running):
        tokens[row, : len(r.tokens)] = r.tokens
    for g in range(len(attention.groups)):
        cols = max(len(r.tables[g]) for r in running)
        table = torch.full((len(running), cols), -1, dtype=torch.int32)
        for row, r in enumerate(running):
            table[row, : len(r.tables[g])] = torch.tensor(r.tables[g], dtype=torch.int32)
        tables.append(table)
    ends = [r.computed + plan[r.id] for r in running]
    return tokens, tables, ends, [r.computed for r in running]


def _stale_foreign(pool, running) -> int:
    """Sliding-table entries before a request's floor that name a block another running request holds."""
    count = 0
    for g, group in enumerate(pool.attention.groups):
        if not group.is_sliding:
            continue
        for r in running:
            held_elsewhere = set().union(*(o.held[g] for o in running if o is not r))
            floor = first_kept_after(r.computed, group.window, group.block_size)
            count += sum(1 for b in r.tables[g][:floor] if b in held_elsewhere)
    return count


class _CountingPacked(HybridLlama):
    """``HybridLlama`` counting its packed steps, so the packed mode shows it ran them."""

    packed = 0

    def forward_packed_grouped(self, *args):
        self.packed += 1
        return super().forward_packed_grouped(*args)


@pytest.mark.parametrize("mode", ["packed", "eager", "traced"])
def test_the_hybrid_scheduler_equals_one_shot_prefills_and_writes_only_its_blocks(mode):
    """Every request's logits equal transformers' within 1e-4; each step changes only blocks it writes."""
    base, hf, types = model_and_oracle("ministral", WINDOW)
    attention = attention_of(types, WINDOW, 16)
    model = _CountingPacked(base, attention)
    kv = model.new_kv_cache(NUM_BLOCKS)
    nan_fill(kv, [[NULL]] * len(attention.groups))
    policy = attrs.evolve(POLICY, packed_steps=mode == "packed")  # packed: the policy packs, eager calls run packed
    executor = PrefillExecutor(build_runtime(model, kv=kv, layout=LAYOUT, policy=policy))
    if mode == "traced":
        executor.warm_up(manifest_for(POLICY, LAYOUT, (SamplingPath.LOGITS,), attention=attention))
    pool = HybridPool(attention, NUM_BLOCKS)
    waiting = [Request(i, p) for i, p in enumerate(_prompts(base.spec.vocab_size))]
    running, done, stale, hits = [], [], 0, 0
    while waiting or running:
        while waiting and len(running) < MAX_SEQS:
            request = waiting.pop(0)
            admit(pool, request)
            hits += request.computed > 0
            running.append(request)
        budget, plan, scheduled = BUDGET, {}, []
        for r in running:
            plan[r.id] = min(budget, len(r.tokens) - r.computed)
            if plan[r.id]:
                budget -= plan[r.id]
                remove_skipped(pool, r)
                grow(pool, r, r.computed + plan[r.id])
                scheduled.append(r)
        stale += _stale_foreign(pool, running)
        tokens, tables, ends, starts = _step_call(scheduled, plan, attention)
        before = [kv.block_bytes(b) for b in range(NUM_BLOCKS)]
        run = "eager" if mode == "packed" else mode
        results = executor.prefill(tokens, tables[0], ends, starts, mode=run, group_page_tables=tables, null_block=0)
        written = {
            r.tables[g][c]
            for r, end in zip(scheduled, ends)
            for g, group in enumerate(attention.groups)
            for c in written_columns(end, r.computed, group.block_size)
        }
        changed = {b for b in range(NUM_BLOCKS) if not torch.equal(kv.block_bytes(b), before[b])}
        assert changed <= written, sorted(changed - written)
        for r, end, result in zip(scheduled, ends, results):
            r.computed = end
            register_full_blocks(pool, r)
            if end == len(r.tokens):
                r.logits = result.logits
                finish(pool, r)
                running.remove(r)
                done.append(r)
    assert hits and stale and pool.reassigned, (hits, stale, pool.reassigned)
    assert (model.packed > 0) == (mode == "packed")
    for r in done:
        expected, _ = hf_logits_and_kv(hf, r.tokens)
        assert torch.allclose(r.logits, expected, rtol=TOL, atol=TOL), (r.id, (r.logits - expected).abs().max())
    executor.close()
