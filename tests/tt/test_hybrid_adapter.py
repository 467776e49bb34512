"""``TtModelAdapter`` over a hybrid TTTv2 model: each KV group's staged tables and window reach ``prefill_forward``.

A 2-group call (a sliding layer with 16-token blocks and a 40-token window, a full layer with 32-token blocks)
runs end to end on the EMULATION: ``TtnnBackend`` stages the padded steps' ``contract.GROUPED_INPUTS``, the
adapter passes them by the contract's names with ``kv_groups``, and the stand-in
(``tests/tt/hybrid_standin.py``) attends per group through ``window_attention`` (ttnn's golden with
``sliding_window_size``). Its logits equal the torch backend's ``HybridLlama`` on the same bfloat16 weights within
the emulation tests' bf16 tolerance (``emulated_lanes.TOLERANCE``). A model that does not declare
``group_tables`` is refused by name, and the adapter refuses a hybrid step's single-table body.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from prefill_core import AttentionLayout, PageTableLayout
from prefill_core.values.errors import PrefillConfigError
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference.windows.hybrid import HybridLlama
from prefill_shell.tt.adapter import GROUP_TABLES_CAPABILITY, TtHybridModel, TtKVCache, TtModelAdapter
from tests import window_kit as kit
from tests.helpers import build_runtime
from tests.tt.emulated_lanes import POLICY, TOLERANCE, assert_logits_close, reference_llama
from tests.tt.hybrid_standin import ReferenceHybridStandIn
from tests.tt.reference_standin import ReferenceLlamaStandIn

WINDOW, NUM_BLOCKS = 40, 96
LAYOUT = PageTableLayout(32, 16, NUM_BLOCKS)
ATTENTION = AttentionLayout.from_layer_types(
    ("sliding_attention", "full_attention"), sliding_window=WINDOW, block_size=32, sliding_block_size=16
)
CASES = {
    "regular wave of 2 rows": ([100, 70], None),
    "one row chunked past the window, cached inside a block": ([300], [70]),
}
"""Lengths and cached lengths: a padded regular wave, and 128-token chunks (POLICY) of a row cached 70."""


def _hybrid() -> HybridLlama:
    return HybridLlama(reference_llama(), ATTENTION)


def _ttnn_runtime(ttnn):
    from prefill_shell.tt.backend import TtnnBackend
    from prefill_shell.tt.emulation import ReferenceEmulation

    hybrid = _hybrid()
    emu = ReferenceEmulation(ttnn)
    standin = ReferenceHybridStandIn(emu, hybrid.model, hybrid.new_kv_cache(NUM_BLOCKS))
    model = TtModelAdapter(standin, hybrid.spec, mesh_device=emu.mesh, ttnn_module=emu, attention=ATTENTION)
    backend = TtnnBackend(emu.mesh, ttnn_module=emu)
    return build_runtime(model, policy=POLICY, backend=backend, kv=standin.kv, layout=LAYOUT), standin


def _torch_runtime():
    hybrid = _hybrid()
    return build_runtime(hybrid, kv=hybrid.new_kv_cache(NUM_BLOCKS), layout=LAYOUT, policy=POLICY)


def _call(lengths):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, reference_llama().spec.vocab_size, (len(lengths), max(lengths)), generator=gen)
    tables = [_table(t) for t in kit.fresh_tables(ATTENTION, lengths)]
    return tokens, tables


def _table(rows) -> torch.Tensor:
    """One group's rows padded with -1 to a ``[rows, width]`` int32 table."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)


def _run(runtime, lengths, cached):
    tokens, tables = _call(lengths)
    batch = runtime.prepare(tokens, tables[0], lengths, cached, group_page_tables=tables, null_block=0)
    return runtime.assemble(PrefillExecutor(runtime).invocations(batch, "eager"), batch.num_rows)


def test_the_hybrid_stand_in_has_exactly_the_hybrid_protocol_signature():
    """Its prefill_forward has TtHybridModel's parameter names, kinds and defaults (no **kwargs): an invented or
    misspelt group keyword from the adapter is a TypeError here."""

    def shape(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert shape(ReferenceHybridStandIn.prefill_forward) == shape(TtHybridModel.prefill_forward)
    assert isinstance(ReferenceHybridStandIn.__new__(ReferenceHybridStandIn), TtHybridModel)


@pytest.mark.parametrize("case", list(CASES))
def test_a_two_group_call_through_the_adapter_equals_the_torch_hybrid_reference(ttnn, case):
    """Logits of every row within the bf16 tolerance; each layer attended with its own group's window."""
    lengths, cached = CASES[case]
    runtime, standin = _ttnn_runtime(ttnn)
    got = _run(runtime, lengths, cached)
    want = _run(_torch_runtime(), lengths, cached)
    assert_logits_close(case, got, want)
    assert {window for _, window in standin.attended} == {WINDOW, None}
    assert all(window == (WINDOW if layer == 0 else None) for layer, window in standin.attended)
    assert len(standin.calls) == len(standin.attended) // 2 >= 1
    assert all(call["chunked"] for call in standin.calls) == (cached is not None)


def test_a_model_without_group_tables_is_refused_by_name_for_a_hybrid_layout(ttnn):
    """The plain stand-in (one page_table per call) is refused when the adapter is given KV groups."""
    from prefill_shell.tt.emulation import ReferenceEmulation

    llama = reference_llama()
    emu = ReferenceEmulation(ttnn)
    plain = ReferenceLlamaStandIn(emu, llama, llama.new_kv_cache(8, 32))
    assert not hasattr(plain, GROUP_TABLES_CAPABILITY)
    with pytest.raises(PrefillConfigError, match=r"ReferenceLlamaStandIn does not declare group_tables = True"):
        TtModelAdapter(plain, llama.spec, mesh_device=emu.mesh, ttnn_module=emu, attention=ATTENTION)


def test_a_hybrid_adapter_refuses_the_single_table_body(ttnn):
    """``forward_hidden`` (one table for every layer) is refused before any model call."""
    runtime, standin = _ttnn_runtime(ttnn)
    with pytest.raises(PrefillConfigError, match="one table per KV group"):
        runtime.config.model.forward_hidden(None, None, None, None, TtKVCache(32, NUM_BLOCKS))
    assert standin.calls == []


def test_behind_the_hybrid_facade_the_model_gets_vllms_groups_and_equals_the_torch_facade(ttnn):
    """Gemma 3's sliding, sliding, full: vLLM makes three groups of one layer, so the facade regroups the adapter
    at allocation and each step hands the TTTv2 model those ``kv_groups``; the logits of a cached row equal the
    torch ``HybridLlama`` behind the same facade, with the same per-layer tables, within the bf16 tolerance."""
    from prefill_shell.backends.torch_backend import TorchBackend
    from prefill_shell.reference import random_llama
    from prefill_shell.serving.hybrid_facade import HybridServingFacade
    from prefill_shell.tt.backend import TtnnBackend
    from prefill_shell.tt.emulation import ReferenceEmulation

    types = ("sliding_attention", "sliding_attention", "full_attention")
    attention = AttentionLayout.from_layer_types(types, sliding_window=WINDOW, block_size=32)
    hybrid = HybridLlama(random_llama(0, "tiny", dtype="bfloat16", num_layers=3), attention)
    emu = ReferenceEmulation(ttnn)
    standin = ReferenceHybridStandIn(emu, hybrid.model, hybrid.new_kv_cache(NUM_BLOCKS))

    def standin_pool(model, num_blocks, buffers):
        standin.kv = hybrid.with_attention(model.attention).new_kv_cache(num_blocks, buffers=buffers)
        return standin.kv

    adapter = TtModelAdapter(standin, hybrid.spec, mesh_device=emu.mesh, ttnn_module=emu, attention=attention)
    facades = [
        HybridServingFacade(
            adapter, TtnnBackend(emu.mesh, ttnn_module=emu), max_seq_len=512, policy=POLICY, kv_factory=standin_pool
        ),
        HybridServingFacade(hybrid, TorchBackend(), max_seq_len=512, policy=POLICY),
    ]
    spec = hybrid.spec
    specs = [((NUM_BLOCKS, spec.num_kv_heads, 32, spec.head_dim), torch.bfloat16, layer) for layer in range(3)]
    tokens = torch.randint(1, spec.vocab_size, (1, 300), generator=torch.Generator().manual_seed(2))
    logits = []
    for facade in facades:
        kv = facade.allocate_kv_cache_per_layer(specs)
        assert facade.model.attention.layer_groups == ((0,), (1,), (2,))
        per_layer = [torch.arange(1 + 10 * g, 11 + 10 * g, dtype=torch.int32)[None] for g in range(3)]
        for end, start in ((70, 0), (300, 70)):
            out = facade.prefill_forward(
                tokens[:, :end],
                per_layer[0],
                enable_trace=False,
                prompt_lens=torch.tensor([end]),
                start_pos=torch.tensor([start]),
                kv_cache=kv,
                page_tables_per_layer=per_layer,
            )
        logits.append(out[:, 0].float())
    assert [len(g.layers) for g in facades[0].model.attention.groups] == [1, 1, 1]
    assert {layer: window for layer, window in standin.attended} == {0: WINDOW, 1: WINDOW, 2: None}
    got, want = logits
    assert (got - want).abs().max() <= TOLERANCE * want.abs().max(), (got - want).abs().max()
