"""A vLLM-like scheduler for a hybrid model: one block-id space, a full and a sliding KV group, prefix caching.

What it keeps from vLLM's v1 hybrid KV cache manager (prefill only):

* one pool of block ids for every group, block 0 its null block (never
  handed out); each group has its own table per request, its own block size
  and its own prefix cache (blocks keyed by group and chained block hash);
* a hit is the longest prefix every group serves: the full group's leading
  run of cached blocks, the sliding group's ``find_longest_cache_hit``
  (``vllm_sliding.longest_sliding_hit``) within it, iterated until they
  agree; it stops one token short of the prompt; the sliding group's table
  holds the null block before the hit's last ``ceil((W - 1) / bs)`` blocks;
* before each step, ``remove_skipped_blocks``: a sliding group's blocks
  before ``first_kept_after(computed)`` are freed (and, unreferenced, go back
  to the pool to be handed to the next allocation) while their ids stay in
  the request's table, as the v1 runner and the Tenstorrent plugin leave
  them: stale ids of blocks another request may now hold;
* a token budget per step, so chunks end inside blocks.

Each step is one ``PrefillExecutor.prefill`` with every group's table.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from prefill_core.values.intmath import ceil_div
from tests.core.vllm_sliding import first_kept_after, longest_sliding_hit


@dataclass
class Request:
    id: int
    tokens: torch.Tensor
    computed: int = 0
    tables: list[list[int]] = field(default_factory=list)  # per group; freed entries stay (stale)
    held: list[set[int]] = field(default_factory=list)  # per group: blocks it still references
    logits: torch.Tensor | None = None


class HybridPool:
    def __init__(self, attention, num_blocks: int):
        self.attention = attention
        self.free: deque[int] = deque(range(1, num_blocks))
        self.ref = dict.fromkeys(range(num_blocks), 0)
        self.cache: dict[tuple[int, tuple], int] = {}  # (group, prefix tokens) -> block
        self.key_of: dict[int, tuple[int, tuple]] = {}
        self.reassigned = 0  # allocations that handed out a block freed while its old table entry stayed

    def allocate(self) -> int:
        block = self.free.popleft()
        key = self.key_of.pop(block, None)
        if key is not None:
            self.cache.pop(key, None)
            self.reassigned += 1
        self.ref[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)

    def hit(self, tokens: torch.Tensor) -> tuple[int, list[list[int]]]:
        """vLLM's common hit over the groups: ``(cached tokens, each group's table prefix)``."""
        groups = self.attention.groups
        bs = groups[0].block_size
        assert all(g.block_size == bs for g in groups), "one block size keeps the hit arithmetic one"
        n = len(tokens)
        keys = [tuple(tokens[: (i + 1) * bs].tolist()) for i in range((n - 1) // bs)]
        flags = [[(g, key) in self.cache for key in keys] for g in range(len(groups))]
        hit = len(keys)
        for g, group in enumerate(groups):
            if not group.is_sliding:
                hit = min(hit, next((i for i, f in enumerate(flags[g]) if not f), len(keys)))
        while True:
            agreed = hit
            for g, group in enumerate(groups):
                if group.is_sliding:
                    agreed = min(agreed, longest_sliding_hit(flags[g][:agreed], group.window, bs))
            if agreed == hit:
                break
            hit = agreed
        tables = []
        for g, group in enumerate(groups):
            first = 0 if not group.is_sliding else max(0, hit - ceil_div(group.window - 1, bs))
            tables.append([0 if c < first else self.cache[g, keys[c]] for c in range(hit)])
        return hit * bs, tables

    def register(self, g: int, block: int, key: tuple) -> None:
        if (g, key) not in self.cache:
            self.cache[g, key] = block
            self.key_of[block] = (g, key)


def admit(pool: HybridPool, request: Request) -> None:
    cached, tables = pool.hit(request.tokens)
    request.computed = cached
    request.tables = tables
    request.held = [set() for _ in tables]
    for g, table in enumerate(tables):
        for block in table:
            if block:
                pool.ref[block] += 1
                request.held[g].add(block)
                if pool.ref[block] == 1:
                    pool.free.remove(block)


def remove_skipped(pool: HybridPool, request: Request) -> None:
    """vLLM's ``remove_skipped_blocks`` at ``num_computed_tokens``: the id stays in the table."""
    for g, group in enumerate(pool.attention.groups):
        if not group.is_sliding:
            continue
        for column in range(first_kept_after(request.computed, group.window, group.block_size)):
            block = request.tables[g][column]
            if block in request.held[g]:
                request.held[g].discard(block)
                pool.release(block)


def grow(pool: HybridPool, request: Request, end: int) -> None:
    """Blocks for positions up to ``end`` in every group (fresh from the pool)."""
    for g, group in enumerate(pool.attention.groups):
        while len(request.tables[g]) < ceil_div(end, group.block_size):
            block = pool.allocate()
            request.tables[g].append(block)
            request.held[g].add(block)


def register_full_blocks(pool: HybridPool, request: Request) -> None:
    for g, group in enumerate(pool.attention.groups):
        bs = group.block_size
        for column in range(request.computed // bs):
            block = request.tables[g][column]
            if block in request.held[g]:
                pool.register(g, block, tuple(request.tokens[: (column + 1) * bs].tolist()))


def finish(pool: HybridPool, request: Request) -> None:
    for g in range(len(request.tables)):
        for block in request.held[g]:
            pool.release(block)
        request.held[g] = set()
