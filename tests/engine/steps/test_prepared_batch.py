"""A prepared call owns copies of what it read: the caller may reuse its tensors before the call runs."""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import RequestKind
from tests.helpers import CHUNK_256_POLICY, assign_blocks, build_runtime, make_tokens, page_table, token_matrix

BLOCK, NUM_BLOCKS = 16, 128
# A wave of two short rows, and a row chunked at 256 with a cached prefix (chunks read the pool's prefix).
LENGTHS, CACHED = [40, 70, 700], [0, 0, 160]


@pytest.mark.parametrize("packed", [False, True])
def test_overwriting_tokens_and_page_table_after_prepare_changes_nothing(tiny_model, packed):
    """Each row's logits equal the same call's with the caller's tensors left alone."""
    tokens = token_matrix([make_tokens(n, seed) for seed, n in enumerate(LENGTHS)])
    table = page_table(assign_blocks(LENGTHS, BLOCK, NUM_BLOCKS, seed=1))
    results = []
    for reuse in (False, True):
        policy = attrs.evolve(CHUNK_256_POLICY, packed_steps=packed)
        runtime = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, policy=policy)
        prefix = runtime.prepare(tokens[2:], table[2:], [CACHED[2]])  # the cached row's prefix, written first
        runtime.assemble(runtime.invocations(prefix), 1)
        mine_tokens, mine_table = tokens.clone(), table.clone()
        batch = runtime.prepare(mine_tokens, mine_table, LENGTHS, CACHED)
        assert (batch.requests[0].request.kind is RequestKind.PACKED) == packed
        if reuse:  # the caller moves on: the next call's rows land in the same tensors
            mine_tokens.random_(1, 200)
            mine_table.fill_(NUM_BLOCKS - 1)
        results.append([r.logits for r in runtime.assemble(runtime.invocations(batch), len(LENGTHS))])
    for kept, reused in zip(*results, strict=True):
        assert torch.equal(kept, reused)
