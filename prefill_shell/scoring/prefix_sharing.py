"""Rows that share a prompt prefix share its KV blocks: one prefill of each shared prefix, then the rest cached.

Rows are shared in groups: ``sharing_groups`` puts rows that start with the
same first block together (A+x, A+y, B+x, B+y give {A+x, A+y} and
{B+x, B+y}), and each group shares the whole blocks all its rows start with.
Only whole blocks can be shared, so a group's shared part is
``floor(common_prefix / block_size) * block_size`` tokens. Each sharing row's
page-table row maps its group's prefix blocks first and then blocks of its
own, so every row writes its own partial last block and nothing another row
reads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

import attrs
import torch

from prefill_core import ceil_div

__all__ = [
    "SharedPrefixBatch",
    "common_prefix_length",
    "share_prefix",
    "share_prefixes",
    "sharing_groups",
]


@attrs.frozen(eq=False)
class SharedPrefixBatch:
    """A batch in the runtime's tensor form whose sharing groups each hold their prefix's blocks once.

    ``prefixes[g]`` (block aligned, non-empty) lives in ``prefix_block_rows[g]``;
    ``cached[i]`` is its length for a row of group ``g`` and 0 for a row in no group.
    """

    tokens: torch.Tensor  # int64 [rows, longest]
    page_table: torch.Tensor  # int32 [rows, widest]; -1 past a row's blocks
    lengths: tuple[int, ...]
    cached: tuple[int, ...]
    prefixes: tuple[tuple[int, ...], ...]
    prefix_block_rows: tuple[tuple[int, ...], ...]
    num_blocks: int

    @property
    def max_blocks_per_row(self) -> int:
        return self.page_table.shape[1]

    @property
    def prefix_tokens(self) -> tuple[int, ...]:
        """Every shared token, group after group (one group: its prefix; empty when nothing is shared)."""
        return tuple(token for prefix in self.prefixes for token in prefix)

    @property
    def prefix_blocks(self) -> tuple[int, ...]:
        """Every shared block, group after group."""
        return tuple(block for blocks in self.prefix_block_rows for block in blocks)

    def prefix_call(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(tokens, page table, lengths) of the call that fills every group's shared blocks: one row per group."""
        longest = max((len(p) for p in self.prefixes), default=0)
        widest = max((len(b) for b in self.prefix_block_rows), default=0)
        tokens = torch.zeros(len(self.prefixes), longest, dtype=torch.int64)
        table = torch.full((len(self.prefixes), widest), -1, dtype=torch.int32)
        for row, (prefix, blocks) in enumerate(zip(self.prefixes, self.prefix_block_rows)):
            tokens[row, : len(prefix)] = torch.tensor(prefix, dtype=torch.int64)
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return tokens, table, [len(p) for p in self.prefixes]


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


def sharing_groups(prompts: Sequence[Sequence[int]], block_size: int) -> list[list[int]]:
    """Every group of at least two rows that start with the same whole first block, in first-row order."""
    by_head: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        if len(prompt) >= block_size:
            by_head[tuple(prompt[:block_size])].append(index)
    return [rows for rows in by_head.values() if len(rows) > 1]


def share_prefix(
    prompts: Sequence[Sequence[int]], block_size: int, members: Collection[int] | None = None
) -> SharedPrefixBatch:
    """Lays ``prompts`` out over disjoint blocks, except the block-aligned prefix the ``members``
    (default: every row) all start with, which is shared when at least two rows share a block of it."""
    return share_prefixes(prompts, block_size, [range(len(prompts)) if members is None else members])


def share_prefixes(
    prompts: Sequence[Sequence[int]], block_size: int, groups: Sequence[Collection[int]]
) -> SharedPrefixBatch:
    """Lays ``prompts`` out over disjoint blocks, except that each of the disjoint ``groups`` shares the
    block-aligned prefix its rows all start with (when it is at least one block and the group two rows)."""
    if not prompts:
        raise ValueError("share_prefixes needs at least one prompt")
    group_of, prefixes, prefix_rows, next_block = {}, [], [], 0
    for members in groups:
        members = sorted(members)
        if members and not 0 <= members[0] <= members[-1] < len(prompts):
            raise ValueError(f"sharing group {members} names a row outside [0, {len(prompts)})")
        if set(members) & set(group_of):
            raise ValueError(f"sharing groups overlap: row {min(set(members) & set(group_of))} is in two")
        common = common_prefix_length([prompts[i] for i in members]) if len(members) > 1 else 0
        shared = common // block_size * block_size
        if not shared:
            continue
        blocks = tuple(range(next_block, next_block + shared // block_size))
        next_block += len(blocks)
        group_of.update(dict.fromkeys(members, len(prefixes)))
        prefixes.append(tuple(prompts[members[0]][:shared]))
        prefix_rows.append(blocks)
    rows, cached = [], []
    for index, prompt in enumerate(prompts):
        group = group_of.get(index)
        own_start = 0 if group is None else len(prefixes[group])
        need = ceil_div(len(prompt), block_size) - own_start // block_size
        shared_blocks = [] if group is None else list(prefix_rows[group])
        rows.append(shared_blocks + list(range(next_block, next_block + need)))
        next_block += need
        cached.append(own_start)
    return SharedPrefixBatch(
        *_tensors(prompts, rows),
        tuple(len(p) for p in prompts),
        tuple(cached),
        tuple(prefixes),
        tuple(prefix_rows),
        max(next_block, 1),
    )


def _tensors(prompts: Sequence[Sequence[int]], rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The right-padded token matrix and the -1-padded page table."""
    table = torch.full((len(prompts), max(len(r) for r in rows)), -1, dtype=torch.int32)
    tokens = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.int64)
    for index, (row, prompt) in enumerate(zip(rows, prompts)):
        table[index, : len(row)] = torch.tensor(row, dtype=torch.int32)
        tokens[index, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.int64)
    return tokens, table
