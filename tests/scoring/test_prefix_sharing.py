"""Every group of rows that starts with the same whole blocks gets those blocks prefilled once and read from cache."""

from __future__ import annotations

import torch

from prefill_shell.cli.main import make_runtime
from prefill_shell.reference import random_llama
from prefill_shell.scoring.prefix_sharing import share_prefix, share_prefixes, sharing_groups

BS = 32


def _ids(length: int, seed: int) -> list[int]:
    return torch.randint(1, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _two_heads_two_tails() -> list[list[int]]:
    a, b, x, y = _ids(70, 1), _ids(64, 2), _ids(20, 3), _ids(9, 4)
    return [a + x, a + y, b + x, b + y, x]


def test_each_first_block_group_shares_its_own_prefix():
    """A+x, A+y, B+x, B+y: A's and B's whole blocks are each cached once; a row in no group caches nothing."""
    prompts = _two_heads_two_tails()
    groups = sharing_groups(prompts, BS)
    assert groups == [[0, 1], [2, 3]]
    batch = share_prefixes(prompts, BS, groups)
    assert batch.cached == (64, 64, 64, 64, 0)
    assert batch.prefixes == (tuple(prompts[0][:64]), tuple(prompts[2][:64]))
    a_blocks, b_blocks = batch.prefix_block_rows
    assert not set(a_blocks) & set(b_blocks)
    table = batch.page_table.tolist()
    assert table[0][:2] == table[1][:2] == list(a_blocks) and table[2][:2] == table[3][:2] == list(b_blocks)
    own = [block for row in table for block in row[2:] if block >= 0] + [b for b in table[4] if b >= 0]
    assert len(own) == len(set(own)) and not set(own) & set(a_blocks + b_blocks)


def test_shared_groups_give_the_unshared_results():
    """Prefilling each group's prefix once, then the rows with it cached, matches running every row uncached."""
    model = random_llama(0, "tiny")
    prompts = _two_heads_two_tails()
    shared = share_prefixes(prompts, BS, sharing_groups(prompts, BS))
    runtime = make_runtime(model, shared, BS)
    runtime.prefill(*shared.prefix_call())
    cached = runtime.prefill(shared.tokens, shared.page_table, shared.lengths, shared.cached)
    plain = share_prefixes(prompts, BS, [])
    assert plain.cached == (0,) * 5
    uncached = make_runtime(model, plain, BS).prefill(plain.tokens, plain.page_table, plain.lengths)
    for ours, reference in zip(cached, uncached):
        assert torch.allclose(ours.logits, reference.logits, atol=1e-4)


def test_share_prefix_keeps_its_one_group_form():
    """share_prefix(prompts, bs, members) still shares one group; prefix_tokens and prefix_call cover it."""
    prompts = _two_heads_two_tails()
    batch = share_prefix(prompts, BS, [0, 1])
    assert batch.cached == (64, 64, 0, 0, 0)
    assert batch.prefix_tokens == tuple(prompts[0][:64]) and len(batch.prefix_blocks) == 2
    tokens, table, lengths = batch.prefix_call()
    assert tokens.tolist() == [prompts[0][:64]] and lengths == [64] and table.tolist() == [list(batch.prefix_blocks)]
