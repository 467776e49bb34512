"""What the shell and ttnn tests share: the one runtime builder, a 256-token-chunk policy, seeded rows, KV reads.

Tests import what they use by name (``from tests.helpers import build_runtime``); ``tests`` is a package found
from the repository root on ``PYTHONPATH``. The runtime builder and the small policy are shipped in
``prefill_shell.testing`` (``runtime_builder.build_runtime``, ``small.SMALL_POLICY``), which the tests share.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import torch

from prefill_core import PrefillPolicy
from prefill_shell.reference import PagedKVCache
from prefill_shell.testing.runtime_builder import build_runtime

__all__ = [  # build_runtime is re-exported: the tests build runtimes as the shipped test tools do
    "CHUNK_256_POLICY",
    "TOL",
    "VOCAB",
    "CountingModel",
    "ParkingModel",
    "assign_blocks",
    "build_runtime",
    "make_tokens",
    "max_abs_diff",
    "page_table",
    "randomize_pool",
    "row_kv",
    "token_matrix",
]

TOL = 1e-4
"""Largest absolute difference accepted between runtime and oracle values."""

VOCAB = 256

CHUNK_256_POLICY = PrefillPolicy(max_chunk_length=256, chunk_quantum=128, length_ladder=(128, 256))
"""Chunks at 256 tokens, so rows longer than that are chunked at short, cheap lengths.

Not the small policy: that one is ``prefill_shell.testing.small.SMALL_POLICY`` (block 16, 64-token chunks, 4-slot
lanes), which the shipped test tools and the tests that drive them share. This one keeps the defaults' lane size
and logprob cap, and the tests written against it count 128- and 256-token steps.
"""


def make_tokens(length: int, seed: int) -> torch.Tensor:
    """A row of ``length`` seeded tokens in ``[1, VOCAB)`` (never 0, the padding token)."""
    return torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def token_matrix(rows: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Rows right-padded with zeros into an int64 ``[N, T]`` matrix."""
    width = max(len(r) for r in rows) if width is None else width
    out = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def assign_blocks(
    lengths: Sequence[int], block_size: int, num_blocks: int, seed: int, reserved=(0,)
) -> list[list[int]]:
    """Disjoint, shuffled block lists (one per row) covering each row's length; ``reserved`` ids are never used."""
    reserved = set(reserved)
    free = [b for b in range(num_blocks) if b not in reserved]
    random.Random(seed).shuffle(free)
    out = []
    for length in lengths:
        need = -(-length // block_size)
        if need > len(free):
            raise AssertionError(f"pool of {num_blocks} blocks is too small for lengths {list(lengths)}")
        out.append(free[:need])
        free = free[need:]
    return out


def page_table(
    blocks: Sequence[Sequence[int]], width: int | None = None, tails: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """An int32 page table; each row's blocks are followed by its ``tails`` entry (default ``-1``s)."""
    width = max(len(b) for b in blocks) if width is None else width
    table = torch.full((len(blocks), width), -1, dtype=torch.int32)
    for i, row in enumerate(blocks):
        entries = list(row) + (list(tails[i]) if tails is not None else [])
        entries = entries[:width]
        table[i, : len(entries)] = torch.tensor(entries, dtype=torch.int32)
    return table


def randomize_pool(kv: PagedKVCache, seed: int) -> None:
    """Fills every block (sink included) with seeded noise, so stray writes show up."""
    gen = torch.Generator().manual_seed(seed)
    for pool in kv.keys + kv.values:
        pool.copy_(torch.randn(pool.shape, generator=gen))


def row_kv(kv: PagedKVCache, layer: int, blocks: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[0, length)`` of one row read through its blocks: ``[H_kv, length, D]`` each."""
    ids = torch.tensor(list(blocks))

    def unpage(pool: torch.Tensor) -> torch.Tensor:
        part = pool[ids]  # [nb, H_kv, bs, D]
        return part.transpose(0, 1).reshape(part.shape[1], -1, part.shape[3])[:, :length]

    return unpage(kv.keys[layer]), unpage(kv.values[layer])


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item()


class ParkingModel:
    """Delegates to a model; the first body call on ``parked_thread`` waits at a barrier, then for ``go``.

    Thread tests park one call inside the model body this way and act from
    another thread while it is there; ``wait`` bounds every wait, so a broken
    test fails instead of hanging.
    """

    def __init__(self, inner, wait: float = 30.0):
        self.inner, self.spec, self.dtype = inner, inner.spec, inner.dtype
        self.new_kv_cache = inner.new_kv_cache
        self.parked_thread: int | None = None
        self.wait = wait
        self.barrier = threading.Barrier(2, timeout=wait)
        self.go = threading.Event()

    def forward_hidden(self, *args):
        if threading.get_ident() == self.parked_thread and not self.go.is_set():
            self.barrier.wait()
            assert self.go.wait(self.wait), "the main thread never let the parked call go on"
        return self.inner.forward_hidden(*args)

    def lm_head(self, rows):
        return self.inner.lm_head(rows)


class CountingModel:
    """Delegates to a model and counts its hidden-body calls."""

    def __init__(self, inner):
        self.inner = inner
        self.spec = inner.spec
        self.dtype = inner.dtype
        self.body_calls = 0

    def forward_hidden(self, tokens, start, fill_table, read_table, kv):
        self.body_calls += 1
        return self.inner.forward_hidden(tokens, start, fill_table, read_table, kv)

    def lm_head(self, rows):
        return self.inner.lm_head(rows)

    def new_kv_cache(self, num_blocks, block_size):
        return self.inner.new_kv_cache(num_blocks, block_size)
