"""ttnn's windowed chunked SDPA, through the op's own golden function, against the project's window rule.

``ttnn.transformer.chunked_scaled_dot_product_attention`` (0.81.1) takes
``sliding_window_size``; its golden (ttnn's torch reference, what tt-metal's
own tests compare the device against) must see exactly the keys
``prefill_core.kv_groups.windows.read_span`` names: ``q - W < k <= q``. What the golden
reads outside the window is pinned too: it gathers every table entry, so a
NaN block outside the window reaches its output.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core.kv_groups.windows import read_span

BS, HEADS, DIM = 32, 2, 32


def _golden(ttnn):
    return ttnn.transformer.chunked_scaled_dot_product_attention.golden_function


@pytest.mark.parametrize(("start", "window"), [(96, 16), (64, 33), (128, 1), (32, 200), (0, 8)])
def test_the_golden_sees_exactly_the_keys_of_the_window_rule(ttnn, start, window):
    """Each query's output is softmax attention over ``read_span(q, q + 1, window)`` (float32, 1e-5)."""
    gen = torch.Generator().manual_seed(start + window)
    blocks = (start + BS) // BS
    k, v = torch.randn(blocks, HEADS, BS, DIM, generator=gen), torch.randn(blocks, HEADS, BS, DIM, generator=gen)
    q = torch.randn(1, HEADS, BS, DIM, generator=gen)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    out = _golden(ttnn)(q, k, v, table, chunk_start_idx=start, sliding_window_size=window)
    keys = k.transpose(0, 1).reshape(HEADS, -1, DIM)  # [H, positions, D]
    values = v.transpose(0, 1).reshape(HEADS, -1, DIM)
    for i in range(BS):
        span = list(read_span(start + i, start + i + 1, window))
        scores = torch.einsum("hd,hkd->hk", q[0, :, i], keys[:, span]) / DIM**0.5
        expected = torch.einsum("hk,hkd->hd", torch.softmax(scores, -1), values[:, span])
        assert torch.allclose(out[0, :, i], expected, atol=1e-5), (i, span[0], span[-1])


def test_the_golden_reads_every_table_entry_so_a_nan_outside_the_window_reaches_it(ttnn):
    """A NaN block 0 wholly before a 16-token window at chunk start 96 makes the golden's output NaN."""
    k, v = torch.randn(4, HEADS, BS, DIM), torch.randn(4, HEADS, BS, DIM)
    k[0], v[0] = float("nan"), float("nan")
    q = torch.randn(1, HEADS, BS, DIM)
    out = _golden(ttnn)(
        q, k, v, torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), chunk_start_idx=96, sliding_window_size=16
    )
    assert torch.isnan(out).any()
