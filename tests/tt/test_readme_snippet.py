"""docs/tenstorrent.md's snippet runs as written, on the emulation standing in for the ``ttnn`` module."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.tt.emulated_lanes import BLOCK, NUM_BLOCKS, call_args, reference_llama, torch_executor
from tests.tt.reference_standin import ReferenceLlamaStandIn

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tenstorrent.md"
SECTION = "## Running on Tenstorrent hardware"


def readme_snippet() -> str:
    """The first ```python block of docs/tenstorrent.md's Tenstorrent section; fails the test when there is none."""
    text = PAGE.read_text()
    assert SECTION in text, f"docs/tenstorrent.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert block is not None, f"docs/tenstorrent.md's {SECTION!r} section shows no ```python block"
    return block.group(1)


def test_the_snippet_runs_on_the_emulation_and_matches_the_torch_backend(ttnn, monkeypatch):
    """``import ttnn`` resolves to ReferenceEmulation; the snippet's results equal the torch backend's."""
    from prefill_shell.tt.emulation import ReferenceEmulation

    snippet = readme_snippet()
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
    exec(compile(snippet, "docs/tenstorrent.md snippet", "exec"), namespace)
    want = torch_executor().runtime.prefill(args["tokens"], args["page_table"], args["prompt_lengths"])
    assert len(namespace["results"]) == len(want)
    for got, expected in zip(namespace["results"], want):
        assert (got.logits - expected.logits).abs().max().item() <= 0.02 * expected.logits.abs().max().item()
    assert emulation.counts["stand-in.prefill_forward"] == 2  # default policy: a 128-token and a 1024-token step
