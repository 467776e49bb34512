"""Packed steps through the whole runtime match transformers and write only their rows' real positions."""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, RequestKind, SamplingParams, WarmupManifest, ceil_div
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference import random_llama, save_hf_folder
from prefill_shell.reference.llama_like.packed_attention import segment_reads
from tests.helpers import build_runtime

transformers = pytest.importorskip("transformers")

TOL = 1e-4
BUDGET = 128  # tokens per packed step: small, so rows split across steps
VOCAB = 256


@pytest.fixture(scope="module")
def model():
    return random_llama(0, "tiny")


@pytest.fixture(scope="module")
def hf(model, tmp_path_factory):
    folder = save_hf_folder(model, tmp_path_factory.mktemp("tiny"))
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _rows(bs: int) -> list[tuple[int, int]]:
    """(length, cached): uncached short and long, cached prefixes, a fully cached row, a one-token row."""
    return [(200, 0), (37, 0), (150, bs), (2 * bs, 2 * bs), (3 * bs + 5, 2 * bs), (1, 0), (bs + 1, bs)]


class Call:
    """One batch over a pool filled with noise, each row's blocks scattered, cached prefixes prefilled."""

    def __init__(self, model, bs: int, seed: int):
        rows = _rows(bs)
        self.lengths, self.cached = [n for n, _ in rows], [c for _, c in rows]
        need = [ceil_div(n, bs) for n in self.lengths]
        order = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks = [order[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
        self.tokens = torch.randint(
            1, VOCAB, (len(rows), max(self.lengths)), generator=torch.Generator().manual_seed(seed)
        )
        self.table = torch.full((len(rows), max(need)), -1, dtype=torch.int32)
        for i, blocks in enumerate(self.blocks):
            self.table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.kv = model.new_kv_cache(len(order), bs)
        gen = torch.Generator().manual_seed(seed + 1)
        for pool in self.kv.keys + self.kv.values:
            pool.copy_(torch.randn(pool.shape, generator=gen))
        layout = PageTableLayout(bs, max(need), len(order))
        policy = attrs.evolve(PrefillPolicy(), max_chunk_length=BUDGET, packed_steps=True)
        self.runtime = build_runtime(model, kv=self.kv, layout=layout, policy=policy)
        prefixed = [i for i, c in enumerate(self.cached) if c]
        self.runtime.prefill(
            self.tokens[prefixed], self.table[prefixed], [self.cached[i] for i in prefixed]
        )  # the cache a serving engine would hold

    def bytes(self) -> list[torch.Tensor]:
        return [self.kv.block_bytes(b) for b in range(self.kv.num_blocks)]


def _hf_last_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens[None]).logits[0, -1]


@pytest.mark.parametrize("bs", (16, 32, 64))
def test_packed_rows_match_transformers_and_write_only_real_positions(model, hf, bs):
    """Cached, uncached, fully cached and one-token rows, packed 128 tokens a step: logits match transformers;
    blocks outside the rows' written ranges, and positions past each prompt, keep their bytes."""
    call = Call(model, bs, seed=bs)
    prepared = call.runtime.prepare(call.tokens, call.table, call.lengths, call.cached)
    kinds = {p.request.kind for p in prepared.requests}
    steps = [step for p in prepared.requests for step in p.request.steps]
    assert kinds == {RequestKind.PACKED} and len(steps) > 1
    assert any(len({s.start > 0 for s in step.segments}) == 2 for step in steps)  # cached and uncached share a step
    before = call.bytes()
    results = call.runtime.assemble(call.runtime.invocations(prepared), len(call.lengths))
    for i, result in enumerate(results):
        expected = _hf_last_logits(hf, call.tokens[i, : call.lengths[i]])
        diff = (result.logits - expected).abs().max().item()
        assert diff <= TOL, f"row {i} (length {call.lengths[i]}, cached {call.cached[i]}): {diff:.2e}"
    after = call.bytes()
    written = {
        b
        for i, blocks in enumerate(call.blocks)
        if call.cached[i] < call.lengths[i]
        for b in blocks[call.cached[i] // bs :]
    }
    for block in range(call.kv.num_blocks):
        if block not in written:
            assert torch.equal(after[block], before[block]), f"block {block} changed"
    for i, blocks in enumerate(call.blocks):
        tail = call.lengths[i] % bs
        if tail and call.cached[i] < call.lengths[i]:  # the last block's positions past the prompt stay as they were
            last = blocks[-1]
            assert torch.equal(after[last][:, :, :, tail:], before[last][:, :, :, tail:]), f"row {i} wrote past its end"


def test_packed_kv_matches_transformers_cache(model, hf):
    """The K/V a packed call writes (a row split over three steps after a cached prefix) equal transformers' cache."""
    call = Call(model, 32, seed=5)
    call.runtime.prefill(call.tokens, call.table, call.lengths, call.cached)
    row = 4  # 101 tokens, 64 cached
    n = call.lengths[row]
    with torch.no_grad():
        out = hf(call.tokens[row, :n][None], use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    ids = torch.tensor(call.blocks[row])
    for layer in range(model.spec.num_layers):
        for pool, expected in (
            (call.kv.keys[layer], cache.layers[layer].keys[0]),
            (call.kv.values[layer], cache.layers[layer].values[0]),
        ):
            part = pool[ids]
            ours = part.transpose(0, 1).reshape(part.shape[1], -1, part.shape[3])[:, :n]
            assert (ours - expected).abs().max().item() <= TOL


def test_packed_sampled_rows_and_traced_calls(model, hf):
    """Greedy rows packed return transformers' argmax; a traced executor call is planned padded and agrees."""
    call = Call(model, 32, seed=9)
    sampling = [SamplingParams.greedy(num_logprobs=2)] * len(call.lengths)
    packed = call.runtime.prefill(call.tokens, call.table, call.lengths, call.cached, sampling=sampling)
    clear = []  # rows whose top-2 margin in transformers leaves no doubt about the argmax
    for i, result in enumerate(packed):
        expected = _hf_last_logits(hf, call.tokens[i, : call.lengths[i]])
        top2 = expected.topk(2).values
        if (top2[0] - top2[1]).item() > 2 * TOL:
            clear.append(i)
            assert result.token == expected.argmax().item(), f"row {i}"
    assert len(clear) >= len(packed) - 1
    executor = PrefillExecutor(call.runtime)
    padded = call.runtime.prepare(call.tokens, call.table, call.lengths, call.cached, sampling=sampling, mode="traced")
    assert all(p.request.kind is not RequestKind.PACKED for p in padded.requests)
    executor.warm_up(WarmupManifest().observe(padded.requests))
    traced = executor.prefill(call.tokens, call.table, call.lengths, call.cached, sampling=sampling, mode="traced")
    assert [traced[i].token for i in clear] == [packed[i].token for i in clear]
    executor.close()


def test_equal_length_rows_batched_in_one_attention_call_match_transformers(model, hf):
    """Back-to-back uncached rows of one length run as one batched attention call; each matches transformers."""
    bs, lengths, cached = 16, [24, 24, 24, 40, 24, 24, 24], [0, 0, 0, 0, 16, 0, 0]
    need = [ceil_div(n, bs) for n in lengths]
    table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
    for i in range(len(lengths)):
        table[i, : need[i]] = torch.arange(sum(need[:i]), sum(need[: i + 1]))
    tokens = torch.randint(1, VOCAB, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(3))
    layout = PageTableLayout(bs, max(need), sum(need))
    policy = attrs.evolve(PrefillPolicy(), max_chunk_length=256, packed_steps=True)
    runtime = build_runtime(model, layout=layout, policy=policy)
    runtime.prefill(tokens[4:5], table[4:5], [16])
    (step,) = [s for p in runtime.prepare(tokens, table, lengths, cached).requests for s in p.request.steps]
    segments = torch.tensor([[s.offset, s.length, s.start] for s in step.segments])
    reads = segment_reads(segments, table[[s.row for s in step.segments]], bs, torch.float32)
    assert [(r.rows, r.length, r.start) for r in reads.segments] == [(3, 24, 0), (1, 40, 0), (1, 8, 16), (2, 24, 0)]
    for i, result in enumerate(runtime.prefill(tokens, table, lengths, cached)):
        diff = (result.logits - _hf_last_logits(hf, tokens[i, : lengths[i]])).abs().max().item()
        assert diff <= TOL, f"row {i}: {diff:.2e}"
