"""The reference model's CPU LM head: its vocab-major form computes what ``F.linear`` computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefill_shell.reference.llama import VOCAB_MAJOR_MAX_ROWS, vocab_major_head


@pytest.mark.parametrize("rows", [1, 2, 5, VOCAB_MAJOR_MAX_ROWS])
def test_vocab_major_head_matches_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    head, hidden = torch.randn(1000, 64, generator=gen), torch.randn(rows, 64, generator=gen)
    logits = vocab_major_head(head, hidden)
    assert logits.shape == (rows, 1000) and logits.dtype == torch.float32 and logits.is_contiguous()
    torch.testing.assert_close(logits, F.linear(hidden, head), rtol=1e-5, atol=1e-4)


def test_vocab_major_head_keeps_each_row_apart():
    """Row i's logits depend on row i only (the one-row case sends the row twice and keeps one)."""
    gen = torch.Generator().manual_seed(0)
    head, hidden = torch.randn(500, 32, generator=gen), torch.randn(3, 32, generator=gen)
    together = vocab_major_head(head, hidden)
    for i in range(3):
        torch.testing.assert_close(together[i], vocab_major_head(head, hidden[i : i + 1])[0], rtol=1e-5, atol=1e-4)
