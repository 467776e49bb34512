"""Rows that share a prompt prefix share its KV blocks: one prefill of the prefix, then the rest cached.

Only whole blocks can be shared, so the shared part is
``floor(common_prefix / block_size) * block_size`` tokens. Each sharing row's
page-table row maps those prefix blocks first and then blocks of its own,
so every row writes its own partial last block and nothing another row reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

import attrs
import torch

from prefill_core import ceil_div

__all__ = ["SharedPrefixBatch", "common_prefix_length", "largest_sharing_group", "share_prefix"]


@attrs.frozen(eq=False)
class SharedPrefixBatch:
    """A batch in the runtime's tensor form with one prefix's blocks shared by ``members``.

    ``prefix_tokens`` (block aligned, possibly empty) lives in ``prefix_blocks``;
    ``cached[i]`` is its length for a member and 0 otherwise.
    """

    tokens: torch.Tensor  # int64 [rows, longest]
    page_table: torch.Tensor  # int32 [rows, widest]; -1 past a row's blocks
    lengths: tuple[int, ...]
    cached: tuple[int, ...]
    prefix_tokens: tuple[int, ...]
    prefix_blocks: tuple[int, ...]
    num_blocks: int

    @property
    def max_blocks_per_row(self) -> int:
        return self.page_table.shape[1]

    def prefix_call(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(tokens, page table, lengths) of the one-row call that fills the shared blocks."""
        tokens = torch.tensor([self.prefix_tokens], dtype=torch.int64)
        table = torch.tensor([self.prefix_blocks], dtype=torch.int32)
        return tokens, table, [len(self.prefix_tokens)]


def common_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every prompt starts with."""
    if not prompts:
        return 0
    first, length = prompts[0], min(len(p) for p in prompts)
    for prompt in prompts[1:]:
        same = 0
        while same < length and prompt[same] == first[same]:
            same += 1
        length = same
    return length


def largest_sharing_group(prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """The rows whose first block is the most common first block, if at least two share it (else none)."""
    heads = Counter(tuple(p[:block_size]) for p in prompts if len(p) >= block_size)
    if not heads:
        return []
    head, count = heads.most_common(1)[0]
    return [i for i, p in enumerate(prompts) if tuple(p[:block_size]) == head] if count > 1 else []


def share_prefix(
    prompts: Sequence[Sequence[int]], block_size: int, members: Collection[int] | None = None
) -> SharedPrefixBatch:
    """Lays ``prompts`` out over disjoint blocks, except the block-aligned prefix the ``members``
    (default: every row) all start with, which is shared when at least two rows share a block of it."""
    members = sorted(range(len(prompts)) if members is None else members)
    common = common_prefix_length([prompts[i] for i in members]) if len(members) > 1 else 0
    shared = common // block_size * block_size
    prefix_blocks = list(range(shared // block_size))
    next_block = len(prefix_blocks)
    rows, cached = [], []
    for index, prompt in enumerate(prompts):
        own_start = shared if index in members else 0
        need = ceil_div(len(prompt), block_size) - own_start // block_size
        row = (prefix_blocks if own_start else []) + list(range(next_block, next_block + need))
        next_block += need
        rows.append(row)
        cached.append(own_start)
    width = max(len(r) for r in rows)
    table = torch.full((len(prompts), width), -1, dtype=torch.int32)
    tokens = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.int64)
    for index, (row, prompt) in enumerate(zip(rows, prompts)):
        table[index, : len(row)] = torch.tensor(row, dtype=torch.int32)
        tokens[index, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.int64)
    prefix = tuple(prompts[members[0]][:shared]) if shared else ()
    return SharedPrefixBatch(
        tokens, table, tuple(len(p) for p in prompts), tuple(cached), prefix, tuple(prefix_blocks), max(next_block, 1)
    )
