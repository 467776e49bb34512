"""Gemma 3 through the runtime, packed, padded and traced, with prompt log-probs, as vLLM would send two calls.

``HybridLlama(PagedGemma3)`` runs the windowed-runtime test's two calls
(``test_windowed_runtime._calls``): each row's prefix first, then, after the
blocks that left the window are freed (NaN, their entries the null block for
row 0 and the other row's blocks for row 1), the rest from unaligned cached
offsets; packed, both rows' segments share steps. Logits, prompt log-probs of every computed position (and their
top-2) and the in-window KV equal ``Gemma3ForCausalLM``'s within 1e-4; the
NaN null block is byte-identical after each call.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import RequestKind, WarmupManifest
from prefill_core.values.sampling import SamplingParams
from prefill_shell.backends.torch_backend import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference.windows.hybrid import HybridLlama
from tests import window_kit as kit
from tests.engine.test_windowed_runtime import CACHED, LAYOUT, LENGTHS, WINDOW, _calls, _table
from tests.reference.windows.test_windowed import check_in_window_kv

pytest.importorskip("transformers")

TOP = 2


def _check_prompt_logprobs(result, prompt: torch.Tensor, expected: torch.Tensor, start: int) -> None:
    assert [e.position for e in result.prompt_logprobs] == list(range(start + 1, len(prompt)))
    for e in result.prompt_logprobs:
        want = expected[e.position - 1]
        assert e.token == int(prompt[e.position])
        assert abs(e.logprob - want[e.token].item()) <= kit.TOL * max(1.0, abs(want[e.token].item()))
        for (token, value), best in zip(e.top, torch.topk(want, TOP).values.tolist()):
            assert abs(value - best) <= kit.TOL * max(1.0, abs(best)) and token in torch.topk(want, TOP + 1).indices


@pytest.mark.parametrize("mode", ["packed", "eager", "traced"])
def test_a_gemma3_call_through_the_runtime_equals_transformers(mode):
    """Both rows' logits, prompt log-probs and in-window KV equal ``Gemma3ForCausalLM``'s; the null block holds."""
    base, hf, types = kit.model_and_oracle("gemma3", WINDOW)
    attention = kit.attention_of(types, WINDOW, 8)
    model = HybridLlama(base, attention)
    kv = model.new_kv_cache(LAYOUT.num_blocks)
    kit.nan_fill(kv, [[kit.NULL]] * len(attention.groups))
    policy = attrs.evolve(kit.POLICY, packed_steps=mode == "packed")
    runtime = PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(), kv, LAYOUT, policy))
    executor = PrefillExecutor(runtime)
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, base.spec.vocab_size, (n,), generator=gen) for n in LENGTHS]
    tokens = torch.zeros(2, max(LENGTHS), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    null_bytes = kv.block_bytes(kit.NULL)
    sampling = SamplingParams.greedy(prompt_logprobs=TOP)
    for lengths, cached, tables in _calls(kv, attention):
        page_tables = [_table(t) for t in tables]
        batch = runtime.prepare(
            tokens, page_tables[0], lengths, cached, sampling=sampling, group_page_tables=page_tables, null_block=0
        )
        assert all((p.request.kind is RequestKind.PACKED) == (mode == "packed") for p in batch.requests)
        if mode == "traced":
            executor.warm_up(WarmupManifest().observe(batch.requests))
            assert runtime.captured_traces()
        results = runtime.assemble(executor.invocations(batch, "traced" if mode == "traced" else "eager"), 2)
        assert torch.equal(kv.block_bytes(kit.NULL), null_bytes)
    for row, result in enumerate(results):
        with torch.no_grad():
            out = hf(prompts[row][None], use_cache=True)
        expected = torch.log_softmax(out.logits[0].float(), dim=-1)
        assert result.token == int(expected[-1].argmax())
        _check_prompt_logprobs(result, prompts[row], expected, CACHED[row])
        hf_kv = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
        check_in_window_kv(kv, [t[row] for t in tables], hf_kv, LENGTHS[row], WINDOW)
    executor.close()
