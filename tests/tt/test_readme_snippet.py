"""The README's Tenstorrent snippet runs as written, on the emulation standing in for the ``ttnn`` module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from emulated_lanes import BLOCK, NUM_BLOCKS, call_args, reference_llama, torch_executor
from reference_standin import ReferenceLlamaStandIn

SNIPPET = """\
import ttnn
from prefill_core import PrefillPolicy
from prefill_shell.config import PrefillRuntimeConfig
from prefill_shell.runtime import PrefillRuntime
from prefill_shell.tt.adapter import TtKVCache, TtModelAdapter
from prefill_shell.tt.backend import TtnnBackend

mesh = ttnn.open_mesh_device(ttnn.MeshShape(1, 1), trace_region_size=32 << 20)
backend = TtnnBackend(mesh)  # one lane; a lane group runs one per submesh (see "Lanes")
model = TtModelAdapter(tt_model, spec, mesh_device=mesh)  # a TTTv2 model (embed_prefill, prefill_forward, ...)
kv = TtKVCache(block_size=32, num_blocks=num_blocks)  # the geometry of the paged KV pool bound in tt_model
runtime = PrefillRuntime(PrefillRuntimeConfig.resolve(model, backend, kv, policy=PrefillPolicy()))
results = runtime.prefill(tokens, page_table, prompt_lengths=lengths)
"""
"""The text README.md's "Running on Tenstorrent hardware" section shows."""
README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_snippet_runs_on_the_emulation_and_matches_the_torch_backend(ttnn, monkeypatch):
    """``import ttnn`` resolves to ReferenceEmulation; the snippet's results equal the torch backend's."""
    from prefill_shell.tt.emulation import ReferenceEmulation

    emulation = ReferenceEmulation(ttnn)
    llama = reference_llama()
    monkeypatch.setitem(sys.modules, "ttnn", emulation)
    args = call_args([100, 300])
    namespace = dict(
        tt_model=ReferenceLlamaStandIn(emulation, llama, llama.new_kv_cache(NUM_BLOCKS, BLOCK)),
        spec=llama.spec,
        num_blocks=NUM_BLOCKS,
        tokens=args["tokens"],
        page_table=args["page_table"],
        lengths=args["prompt_lengths"],
    )
    exec(compile(SNIPPET, "README snippet", "exec"), namespace)
    want = torch_executor().runtime.prefill(args["tokens"], args["page_table"], args["prompt_lengths"])
    for got, expected in zip(namespace["results"], want):
        assert (got.logits - expected.logits).abs().max().item() <= 0.02 * expected.logits.abs().max().item()
    assert emulation.counts["stand-in.prefill_forward"] == 2  # default policy: a 128-token and a 1024-token step


def test_the_readme_shows_this_snippet():
    """Once README.md names TtModelAdapter, its snippet is exactly the one tested here."""
    text = README.read_text()
    if "TtModelAdapter" not in text:
        pytest.skip("README.md does not show the TtModelAdapter snippet yet")
    assert SNIPPET in text
