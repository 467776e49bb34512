"""The windowed oracle matrix: families x eager/traced x null/foreign out-of-window entries x block sizes x
cached offsets inside or on a block x window sizes, each through the runtime against transformers.

Every case is one prompt prefilled as vLLM sends it, beside another live request: the other request's call
first, then the prompt's prefix (longer than the window), then, after the blocks that left the window are
freed (NaN) and their entries pointed at the NaN null block or at the other request's blocks, the rest
from the cached offset with prompt log-probs. Checked against transformers within 1e-4: the last token's
top-8 log-probs (its logits, normalised), every computed position's prompt log-prob and the in-window KV;
the null block and the other request's blocks stay byte-identical. Modes: packed steps (the policy packs),
padded waves run eagerly, and padded waves replayed from traces.

``make test`` runs a pairwise-covering subset (every pair of levels of any two factors in some case);
``make fuzz`` (``HYPOTHESIS_PROFILE=fuzz``) runs the whole product.
"""

from __future__ import annotations

import itertools
import os

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, RequestKind, WarmupManifest
from prefill_core.values.intmath import ceil_div
from prefill_core.values.sampling import SamplingParams
from prefill_shell.backends.torch_backend import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference.windows.hybrid import HybridLlama
from tests import window_kit as kit
from tests.engine.test_windowed_runtime import _table
from tests.reference.windows.test_windowed import check_in_window_kv

pytest.importorskip("transformers")

FACTORS = {
    "family": ("mistral", "ministral", "qwen3", "gemma3"),
    "mode": ("packed", "eager", "traced"),  # eager: padded waves run eagerly
    "outside": ("null", "other"),
    "blocks": ((16, 8), (32, 16)),  # (planning block size, sliding group's block size)
    "cached": (70, 64),  # inside a block of either size, or on one; both past every window
    "window": (17, 40),
}
LENGTH, OTHER, POOL = 150, 120, 200
TOP = 8  # the last token's top log-probs stand for its logits


def pairwise(factors: dict[str, tuple]) -> list[tuple]:
    """A deterministic greedy subset of the product covering every pair of levels of every two factors."""
    names = list(factors)
    product = list(itertools.product(*factors.values()))

    def pairs(case):
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(names)), 2)}

    uncovered = set().union(*(pairs(c) for c in product))
    chosen = []
    while uncovered:
        best = max(product, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


FULL = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
CASES = list(itertools.product(*FACTORS.values())) if FULL else pairwise(FACTORS)


def _prompt_logprob_errors(result, prompt: torch.Tensor, expected: torch.Tensor, start: int) -> list:
    assert [e.position for e in result.prompt_logprobs] == list(range(start + 1, len(prompt)))
    bad = []
    for e in result.prompt_logprobs:
        want = expected[e.position - 1, int(prompt[e.position])].item()
        if e.token != int(prompt[e.position]) or abs(e.logprob - want) > kit.TOL * max(1.0, abs(want)):
            bad.append((e.position, e.logprob, want))
    return bad


@pytest.mark.parametrize(("family", "mode", "outside", "blocks", "cached", "window"), CASES)
def test_a_windowed_case_of_the_matrix_equals_transformers(family, mode, outside, blocks, cached, window):
    """Logits, prompt log-probs and in-window KV equal transformers; null and foreign blocks are unchanged."""
    block, sliding_bs = blocks
    base, hf, types = kit.model_and_oracle(family, window)
    attention = kit.attention_of(types, window, sliding_bs, block_size=block)
    model = HybridLlama(base, attention)
    kv = model.new_kv_cache(POOL)
    layout = PageTableLayout(kv.block_size, 32, POOL)  # the largest group's: Mistral has only its sliding group
    kit.nan_fill(kv, [[kit.NULL]] * len(attention.groups))
    policy = attrs.evolve(kit.POLICY, packed_steps=mode == "packed")
    runtime = PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(), kv, layout, policy))
    executor = PrefillExecutor(runtime)
    gen = torch.Generator().manual_seed(cached + window)
    prompt = torch.randint(0, base.spec.vocab_size, (LENGTH,), generator=gen)
    other = torch.randint(0, base.spec.vocab_size, (OTHER,), generator=gen)
    tables = kit.fresh_tables(attention, [LENGTH, OTHER])

    def call(tokens, length, done, rows, sampling=None):
        page_tables = [_table([r]) for r in rows]
        batch = runtime.prepare(
            tokens[None], page_tables[0], [length], [done], sampling=sampling, group_page_tables=page_tables,
            null_block=kit.NULL,
        )  # fmt: skip
        kinds = {p.request.kind for p in batch.requests}
        assert kinds == {RequestKind.PACKED} if mode == "packed" else RequestKind.PACKED not in kinds
        if mode == "traced":
            executor.warm_up(WarmupManifest().observe(batch.requests))
        run = "traced" if mode == "traced" else "eager"
        return runtime.assemble(executor.invocations(batch, run), batch.num_rows)[0]

    call(other, OTHER, 0, [t[1] for t in tables])
    fixed = {b: kv.block_bytes(b) for t in tables for b in t[1]} | {kit.NULL: kv.block_bytes(kit.NULL)}
    call(prompt, cached, 0, [t[0][: ceil_div(cached, g.block_size)] for t, g in zip(tables, attention.groups)])
    rows = kit.free_left_window(kv, attention, [t[0] for t in tables], [t[1] for t in tables], cached, outside)
    result = call(prompt, LENGTH, cached, rows, SamplingParams.greedy(TOP, prompt_logprobs=0))
    with torch.no_grad():
        out = hf(prompt[None], use_cache=True)
    expected = torch.log_softmax(out.logits[0].float(), dim=-1)
    last = expected[-1]
    assert result.token == int(last.argmax()) and abs(result.logprob - last.max().item()) <= kit.TOL
    got = torch.tensor([value for _, value in result.top_logprobs])
    assert torch.allclose(got, last.topk(TOP).values, rtol=kit.TOL, atol=kit.TOL), got - last.topk(TOP).values
    assert all(abs(last[token].item() - value) <= kit.TOL for token, value in result.top_logprobs)
    assert not _prompt_logprob_errors(result, prompt, expected, cached)
    for b, before in fixed.items():
        assert torch.equal(kv.block_bytes(b), before), f"block {b} (null or the other request's) changed"
    hf_kv = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
    check_in_window_kv(kv, rows, hf_kv, LENGTH, window)
    executor.close()


def test_the_make_test_subset_covers_every_pair_of_levels():
    """The pairwise subset holds every pair of levels of every two factors, in fewer cases than the product."""
    chosen = pairwise(FACTORS)
    names = list(FACTORS)
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            assert any(c[i] == x and c[j] == y for c in chosen), (a, x, b, y)
    assert len(chosen) < len(list(itertools.product(*FACTORS.values()))) // 8
