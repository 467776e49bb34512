"""A KV group's chunked attention on ttnn (``prefill_shell.tt.window_attention``): signature and emulated result.

The call site passes the group's window as ``chunked_scaled_dot_product_attention``'s ``sliding_window_size``
and is checked against the installed ttnn's declared signatures like every call site of ``prefill_shell/tt``
(the scan now reads ``tt.transformer.<op>`` calls too). Run through ``ReferenceEmulation``, which computes the
op with ttnn's own golden function, on the read tables ``prefill_core.prepare_grouped`` plans for a call cached
past its window: each query's output is softmax attention over exactly ``read_span`` of its row's keys.
"""

from __future__ import annotations

from pathlib import Path

import torch

from prefill_core import PageTableLayout, PrefillBatch, prepare_grouped
from prefill_core.kv_groups.windows import read_span
from prefill_shell.tt.emulation import ReferenceEmulation
from prefill_shell.tt.window_attention import group_chunked_attention
from tests import window_kit as kit
from tests.tt.test_conformance import pinned_ttnn  # noqa: F401 (fixture)
from tests.tt.ttnn_signatures import call_sites, nonconforming

SOURCE = Path(__file__).resolve().parents[2] / "prefill_shell" / "tt" / "window_attention.py"
HEADS, DIM = 2, 32


def test_the_window_call_site_conforms_and_a_wrong_keyword_would_not(pinned_ttnn):  # noqa: F811
    """The package's chunked-attention call with ``sliding_window_size`` fits ttnn's signature; a misspelling fails."""
    sites = call_sites(SOURCE.read_text(), "window_attention.py")
    assert [s.name for s in sites] == ["transformer.chunked_scaled_dot_product_attention"]
    assert nonconforming(pinned_ttnn, sites) == []
    wrong = "def f(tt, q, k, v, t, s):\n    tt.transformer.chunked_scaled_dot_product_attention(q, k, v, t, window=8)\n"
    assert len(nonconforming(pinned_ttnn, call_sites(wrong, "example.py"))) == 1


def _device(emu, value: torch.Tensor, dtype):
    tt = emu.ttnn
    return emu.to_device(tt.from_torch(value, dtype=dtype, layout=tt.ROW_MAJOR_LAYOUT), emu.mesh)


def test_each_groups_staged_read_table_and_window_through_ttnns_golden_attend_exactly_the_window(ttnn):
    """Every chunked step's output, per KV group, is attention over ``read_span`` of the row's keys (1e-5)."""
    emu = ReferenceEmulation(ttnn)
    window = 24
    attention = kit.attention_of(("sliding_attention", "full_attention"), window, 16, block_size=16)
    tables = kit.fresh_tables(attention, [150])
    batch = PrefillBatch((150,), (70,), (0,), tables[0], (None,))
    (grouped,) = prepare_grouped(batch, kit.POLICY, PageTableLayout(16, 32, 64), attention, tables, null_block=0)
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(64, HEADS, 16, DIM, generator=gen)  # [blocks, heads, bs, D]; block 0 (the filler) is finite
    v = torch.randn(64, HEADS, 16, DIM, generator=gen)
    checked = 0
    for index in range(grouped.request.num_chunks):
        chunk = grouped.request.chunk(index)
        for group, step in zip(attention.groups, grouped.step_tables(index)):
            if step.read is None:
                continue
            q = torch.randn(1, HEADS, chunk.length, DIM, generator=gen)
            start = _device(emu, torch.tensor([chunk.start], dtype=torch.int32), ttnn.int32)
            out = group_chunked_attention(
                emu,
                _device(emu, q, ttnn.float32),
                _device(emu, k, ttnn.float32),
                _device(emu, v, ttnn.float32),
                _device(emu, torch.tensor(step.read, dtype=torch.int32), ttnn.int32),
                start,
                group,
            )
            out = emu.to_torch(emu.from_device(out))
            row = tables[attention.groups.index(group)][0]
            keys = torch.cat([k[b] for b in row], dim=1)  # [heads, positions, D]
            values = torch.cat([v[b] for b in row], dim=1)
            for i in range(min(chunk.length, 150 - chunk.start)):
                span = list(read_span(chunk.start + i, chunk.start + i + 1, group.window))
                scores = torch.einsum("hd,hkd->hk", q[0, :, i], keys[:, span]) / DIM**0.5
                expected = torch.einsum("hk,hkd->hd", torch.softmax(scores, -1), values[:, span])
                assert torch.allclose(out[0, :, i], expected, atol=1e-5), (group.kind, chunk.start + i)
            checked += 1
    assert checked >= 2 and emu.counts["transformer.chunked_scaled_dot_product_attention"] == checked
