"""Shared spans on the reference Llama (``device.model.SHARED_WRITES_CAPABILITY``): rows that begin alike
compute those positions once, and every row's logits and K/V still equal transformers' on the same weights.

The batch is what a serving engine sends: chat rows over one system prompt whose cached blocks they share and
whose tail does not fill a block, a duplicate of one of them (vLLM's ``n > 1``), and two uncached rows that
begin alike; at a 32-token step budget, so the first row's shared positions span steps.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, SamplingParams, ceil_div
from prefill_core.values.pooling import PoolingType
from prefill_shell.device.model import supports_shared_writes
from prefill_shell.reference import random_llama
from prefill_shell.reference.cpu_kernels import library
from prefill_shell.testing.runtime_builder import build_runtime

BS = 16


def _prompts(vocab: int) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(3)

    def draw(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    system, stem = draw(43), draw(25)  # 32 of the system prompt's 43 tokens are cached
    chats = [system + draw(n) for n in (9, 14, 1, 30)]
    prompts = [*chats, list(chats[1]), stem + draw(7), stem + draw(12), draw(20)]
    cached = [32] * 5 + [0, 0, 0]
    return prompts, cached


class Batch:
    """The prompts over scattered blocks of a noise-filled pool, the system prompt's two blocks cached and shared."""

    def __init__(self, model, policy: PrefillPolicy):
        self.prompts, self.cached = _prompts(model.config.vocab_size)
        self.lengths = [len(p) for p in self.prompts]
        need = [ceil_div(n, BS) for n in self.lengths]
        own = [n - (2 if c else 0) for n, c in zip(need, self.cached)]
        order = torch.randperm(sum(own) + 2, generator=torch.Generator().manual_seed(5)).tolist()
        shared, rest = order[:2], order[2:]
        self.tokens = torch.zeros(len(self.prompts), max(self.lengths), dtype=torch.int64)
        self.table = torch.full((len(self.prompts), max(need)), -1, dtype=torch.int32)
        for i, (prompt, cached, n) in enumerate(zip(self.prompts, self.cached, own)):
            self.tokens[i, : len(prompt)] = torch.tensor(prompt)
            blocks = (shared if cached else []) + rest[:n]
            rest = rest[n:]
            self.table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.kv = model.new_kv_cache(len(order), BS)
        gen = torch.Generator().manual_seed(7)
        for pool in self.kv.keys + self.kv.values:
            pool.copy_(torch.randn(pool.shape, generator=gen))
        layout = PageTableLayout(BS, max(need), len(order))
        self.runtime = build_runtime(model, kv=self.kv, layout=layout, policy=policy)
        self.runtime.prefill(self.tokens[:1, :32], self.table[:1, :2], [32])  # the shared blocks, once

    def call(self, **kwargs):
        return self.runtime.prefill(self.tokens, self.table, self.lengths, self.cached, **kwargs)

    def row_kv(self, row: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s keys and values of ``layer`` as ``[Hkv, length, D]``, read through its page table."""
        n = self.lengths[row]
        blocks = self.table[row, : ceil_div(n, BS)].long()
        k = self.kv.keys[layer][blocks].permute(1, 0, 2, 3).flatten(1, 2)[:, :n]
        v = self.kv.values[layer][blocks].permute(1, 0, 2, 3).flatten(1, 2)[:, :n]
        return k, v


POLICY = attrs.evolve(PrefillPolicy(), max_chunk_length=32, packed_steps=True)


def _spy(model) -> list[int]:
    """Records, per packed step the model runs, how many shared writes it was handed."""
    seen: list[int] = []
    inner = model.forward_packed

    def forward_packed(*args, shared_writes=None, **kwargs):
        seen.append(0 if shared_writes is None else len(shared_writes))
        return inner(*args, shared_writes=shared_writes, **kwargs)

    model.forward_packed = forward_packed  # the runtime calls the model's attribute
    return seen


def _shared_positions(batch: Batch) -> int:
    """Positions the plan takes from earlier rows: the 11 uncached system tokens in each of rows 1-3, 24 in row
    4 (row 1's duplicate: all it owes but its last token, 11 from row 0 and 13 from row 1), and the 25 stem
    tokens of row 6."""
    return 11 * 3 + 24 + 25


def test_rows_that_begin_alike_match_transformers_logits_and_kv(tiny_model, oracle):
    """Every row's last-token logits and every K/V it owes (taken or computed) equal transformers' on the same
    weights, and the model was handed exactly the shared positions the plan names."""
    assert supports_shared_writes(tiny_model)
    batch = Batch(tiny_model, POLICY)
    seen = _spy(tiny_model)
    try:
        results = batch.call()
    finally:
        del tiny_model.forward_packed
    assert sum(seen) == _shared_positions(batch) and len(seen) > 1
    for row, prompt in enumerate(batch.prompts):
        ids = torch.tensor(prompt)
        torch.testing.assert_close(results[row].logits, oracle.logits(ids), rtol=1e-4, atol=1e-4)
        keys, values = oracle.kv(ids)
        for layer in range(len(keys)):
            k, v = batch.row_kv(row, layer)
            start = batch.cached[row]
            torch.testing.assert_close(k[:, start:], keys[layer][:, start:], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v[:, start:], values[layer][:, start:], rtol=1e-4, atol=1e-4)


MODELS = [
    pytest.param("bench", torch.float32, id="bench-float32"),  # head size 64: the CPU kernels' case
    pytest.param(
        "bench",
        torch.bfloat16,
        id="bench-bfloat16",
        marks=pytest.mark.skipif(torch.bfloat16 not in library.kernel_dtypes(), reason="no bfloat16 kernels"),
    ),
]


@pytest.mark.parametrize("name, dtype", MODELS)
def test_a_taken_positions_kv_is_its_sources_bit_for_bit_and_results_match_the_plain_model(name, dtype):
    """On the CPU kernels' path: a row's taken K/V are the source row's bit for bit; tokens, log-probs and the
    pooled vectors (LAST shares, MEAN reads every position so never does) equal the same model's without the
    capability, the pools within the dtype's rounding."""
    model = random_llama(0, name, dtype=str(dtype).removeprefix("torch."))
    plain = random_llama(0, name, dtype=str(dtype).removeprefix("torch."))
    plain.shared_writes = False
    ours, theirs = Batch(model, POLICY), Batch(plain, POLICY)
    greedy = SamplingParams.greedy(num_logprobs=3)
    mean = [PoolingType.MEAN if c == 0 else None for c in ours.cached]
    calls = [{"sampling": greedy}, {"pooling": [PoolingType.LAST] * 8}, {"pooling": mean}]
    for kwargs in calls:
        got, want = ours.call(**kwargs), theirs.call(**kwargs)
        for a, b in zip(got, want):
            assert a.token == b.token
            if a.logprob is not None:
                assert a.logprob == pytest.approx(b.logprob, abs=1e-3 if dtype == torch.float32 else 0.1)
            if a.pooled is not None:
                tol = 1e-4 if dtype == torch.float32 else 0.05
                torch.testing.assert_close(a.pooled, b.pooled, rtol=tol, atol=tol)
    for layer in range(len(ours.kv.keys)):
        k1, v1 = ours.row_kv(1, layer)
        k4, v4 = ours.row_kv(4, layer)  # row 1's duplicate
        assert torch.equal(k1[:, :-1], k4[:, :-1]) and torch.equal(v1[:, :-1], v4[:, :-1])
        for row in range(len(ours.prompts)):
            start = ours.cached[row]
            for a, b in zip(ours.row_kv(row, layer), theirs.row_kv(row, layer)):
                tol = 1e-5 if dtype == torch.float32 else 0.02
                torch.testing.assert_close(a[:, start:], b[:, start:], rtol=tol, atol=tol)


def test_prompt_logprobs_rows_compute_what_they_score():
    """A row asking for prompt log-probs computes every position it scores: its prompt log-probs equal the plain
    model's, while the rows without them still share."""
    model = random_llama(0, "tiny")
    plain = random_llama(0, "tiny")
    plain.shared_writes = False
    ours, theirs = Batch(model, POLICY), Batch(plain, POLICY)
    sampling = [SamplingParams.greedy()] * 8
    sampling[1] = SamplingParams.greedy(prompt_logprobs=2)
    seen = _spy(model)
    got, want = ours.call(sampling=sampling), theirs.call(sampling=sampling)
    assert 0 < sum(seen) < _shared_positions(ours)
    assert len(got[1].prompt_logprobs) == len(want[1].prompt_logprobs) > 0
    for a, b in zip(got[1].prompt_logprobs, want[1].prompt_logprobs):
        if a is None:
            assert b is None
            continue
        assert a[0] == b[0]
        assert a[1] == pytest.approx(b[1], abs=1e-4)


def test_a_failure_in_a_step_with_shared_writes_names_the_takers_blocks():
    """The model raises on the first step that carries shared writes: the error's ``partial_writes`` names, for
    each row taking positions in it, the blocks those positions lie in (a prefix cache must drop them)."""
    model = random_llama(0, "tiny")
    batch = Batch(model, POLICY)
    prepared = batch.runtime.prepare(batch.tokens, batch.table, batch.lengths, batch.cached, mode="eager")
    steps = [step for p in prepared.requests for step in p.request.steps]
    failing = next(i for i, step in enumerate(steps) if step.shared)
    inner, calls = model.forward_packed, []

    def forward_packed(*args, **kwargs):
        calls.append(1)
        if len(calls) == failing + 1:
            raise RuntimeError("injected failure in the step with shared writes")
        return inner(*args, **kwargs)

    model.forward_packed = forward_packed
    with pytest.raises(RuntimeError, match="injected") as info:
        batch.call()
    written = info.value.partial_writes
    for w in steps[failing].shared:
        blocks = batch.table[w.row, w.start // BS : ceil_div(w.end, BS)].tolist()
        assert set(blocks) <= set(written[w.row]), (w, written)
