"""The README quickstart's call, unchanged, on windowed folders: one ``page_table`` serves every KV group.

A Mistral folder (every layer slides) and a Gemma 3 folder (sliding and full
layers), saved by transformers' own classes, loaded by the one loader
(``load_model_folder``), allocated as any model is
(``new_kv_cache(num_blocks=, block_size=)``: a buffer per layer), and called
as the quickstart calls a Llama: ``runtime.prefill(tokens, page_table, ...)``
with no group tables, then a longer prompt over the first row's cached blocks.
The call used to be refused (``group_page_tables is invalid``). Each row's
last-token logits must equal transformers' on the same weights within 1e-4,
eager (packed and padded) and traced.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PrefillInputError, WarmupManifest
from prefill_shell import PrefillExecutor, PrefillRuntime, PrefillRuntimeConfig, TorchBackend
from prefill_shell.reference.loading.model_folder import load_model_folder
from tests import window_kit as kit

pytest.importorskip("transformers")

WINDOW = 40


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def folder_and_oracle(request, tmp_path_factory):
    _, hf, _ = kit.model_and_oracle(request.param, WINDOW)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return folder, hf


def _oracle(hf, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(prompt[None]).logits[0, -1]


@pytest.mark.parametrize("mode", ["packed", "eager", "traced"])
def test_the_quickstart_call_on_a_windowed_folder_equals_transformers(folder_and_oracle, mode):
    """Three rows (300, 40, 128 tokens), then row 0 extended by 20 tokens over its 256 cached ones."""
    folder, hf = folder_and_oracle
    model = load_model_folder(folder, block_size=32)
    assert model.attention is not None and any(g.is_sliding for g in model.attention.groups)
    kv = model.new_kv_cache(num_blocks=64, block_size=32)
    layout = PageTableLayout(block_size=32, max_num_blocks_per_seq=32, num_blocks=64)
    config = PrefillRuntimeConfig.resolve(model, TorchBackend("cpu"), kv, layout)
    config = attrs.evolve(config, policy=attrs.evolve(config.policy, packed_steps=mode == "packed"))
    runtime = PrefillRuntime(config)
    executor = PrefillExecutor(runtime)
    run = "eager" if mode != "traced" else "traced"
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, model.spec.vocab_size, (3, 300), generator=gen)
    page_table = torch.arange(30, dtype=torch.int32).reshape(3, 10)
    lengths = [300, 40, 128]
    if mode == "traced":
        executor.warm_up(WarmupManifest().observe(runtime.prepare(tokens, page_table, lengths, mode=run).requests))
    results = executor.prefill(tokens, page_table, lengths, mode=run)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(results[row].logits, _oracle(hf, tokens[row, :n]), atol=kit.TOL, rtol=kit.TOL)
    longer = torch.cat((tokens[0], torch.randint(1, model.spec.vocab_size, (20,), generator=gen)))[None]
    table = torch.tensor([list(range(8)) + [30, 31]], dtype=torch.int32)
    if mode == "traced":
        executor.warm_up(WarmupManifest().observe(runtime.prepare(longer, table, [320], [256], mode=run).requests))
    (tail,) = executor.prefill(longer, table, [320], [256], mode=run)
    torch.testing.assert_close(tail.logits, _oracle(hf, longer[0]), atol=kit.TOL, rtol=kit.TOL)


def test_one_table_over_vllms_shared_buffers_is_refused_by_name(folder_and_oracle):
    """A pool in vLLM's plan (groups share buffers) cannot take one table for two groups: a named error."""
    folder, _ = folder_and_oracle
    model = load_model_folder(folder, block_size=32)
    layout = PageTableLayout(block_size=32, max_num_blocks_per_seq=32, num_blocks=64)
    kv = model.new_kv_cache(64)  # vLLM's plan: KVBuffers.shared
    runtime = PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend("cpu"), kv, layout))
    tokens = torch.ones(1, 40, dtype=torch.int64)
    if not kv.buffers.shares_pages:
        pytest.skip("one KV group: vLLM's plan already keeps a buffer per layer")
    with pytest.raises(PrefillInputError, match="group_page_tables"):
        runtime.prefill(tokens, torch.arange(2, dtype=torch.int32)[None], [40])
