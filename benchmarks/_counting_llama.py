"""``CountingLlama``: the reference Llama, instrumented to count the positions its body computes.

The count is taken inside the model body (the rows each layer's MLP
computes), not derived from the plan: what it measures is what the runtime
asked the model to compute. Padding rows (every token 0; the benchmark's
real tokens are never 0) are counted apart. Attention's arithmetic is
skipped (``_sdpa`` returns zeros): a count needs the positions, not the
scores, and the long workloads' attention would take minutes on a CPU.
"""

from __future__ import annotations

import torch

from prefill_core import PageTableLayout, PrefillPolicy, ceil_div
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.reference import PagedLlama, random_llama

__all__ = ["CountingLlama", "body_positions"]


class CountingLlama(PagedLlama):
    """``PagedLlama`` that counts computed positions (``computed``) and padding-row positions (``padding``)."""

    def __init__(self, base: PagedLlama):
        super().__init__(base.config, base.weights)
        self.computed = self.padding = 0

    def forward_hidden(self, tokens, start, fill_table, read_table, kv, **kwargs):
        self.padding += int((tokens == 0).all(dim=1).sum()) * tokens.shape[1]
        return super().forward_hidden(tokens, start, fill_table, read_table, kv, **kwargs)

    def _mlp(self, layer, x, residual):
        if layer is self._layers[0]:
            self.computed += x.view(-1, x.shape[-1]).shape[0]
        return PagedLlama._mlp(layer, x, residual)

    def _sdpa(self, q, k, v, **kwargs):
        return torch.zeros_like(q)


def _call(shapes: list[tuple[int, int]], bs: int):
    """Tokens (never 0) and a page table of disjoint consecutive blocks for rows of ``(length, cached)``."""
    need = [ceil_div(n, bs) for n, _ in shapes]
    table = torch.full((len(shapes), max(need)), -1, dtype=torch.int32)
    first = 0
    for row, n in enumerate(need):
        table[row, :n] = torch.arange(first, first + n)
        first += n
    tokens = torch.ones(len(shapes), max(n for n, _ in shapes), dtype=torch.int64)
    return tokens, table, [n for n, _ in shapes], [c for _, c in shapes], first


def body_positions(batches: list[list[tuple[int, int]]], bs: int, padded: bool) -> int:
    """Positions of real rows the instrumented body computes over ``batches``.

    ``padded``: ``PrefillPolicy()`` (the ttnn backend's preferred policy,
    tt-metal's ladder) planned as padded waves; otherwise the torch backend's
    preferred policy on the CPU (packed steps).
    """
    longest = max(n for shapes in batches for n, _ in shapes)
    model = CountingLlama(random_llama(0, "tiny", num_layers=1, max_position_embeddings=max(longest, 4096)))
    total = 0
    for shapes in batches:
        tokens, table, lengths, cached, num_blocks = _call(shapes, bs)
        kv = model.new_kv_cache(num_blocks, bs)
        layout = PageTableLayout(bs, table.shape[1], num_blocks)
        policy = PrefillPolicy() if padded else TorchBackend().preferred_policy(bs)
        runtime = PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(), kv, layout, policy))
        model.computed = model.padding = 0
        runtime.prefill(tokens, table, lengths, cached)
        total += model.computed - model.padding
    return total
