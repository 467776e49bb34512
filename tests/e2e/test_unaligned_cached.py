"""Cached offsets anywhere: a prompt prefilled in steps that end inside blocks equals its one-shot prefill.

Each step hands the runtime the whole token row with ``cached_lengths`` =
what earlier steps computed, as vLLM's chunked prefill does; a step whose
start lies inside a block recomputes that block's cached part and rewrites
the row's own block. Logits (every step's last token) and the row's KV must
equal a one-shot prefill of the same prefix within 1e-4, eager and traced.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, WarmupManifest
from prefill_shell.engine.executor import PrefillExecutor

BLOCK = 16
LAYOUT = PageTableLayout(BLOCK, 32, 96)
"""Capacity 512 tokens at block size 16."""
POLICY = PrefillPolicy(max_chunk_length=256, chunk_quantum=128, length_ladder=(128, 256))

CUTS = {0: (45, 130, 300), 1: (1, 17, 33, 77), 2: (150, 151)}
"""Row -> the ends of its successive steps (the last is its prompt length); none but 0 and 33 aligned."""


@pytest.fixture(scope="module")
def rows(kit):
    """Seeded prompts and disjoint blocks for the rows of ``CUTS``."""
    lengths = [cuts[-1] for cuts in CUTS.values()]
    tokens = [kit.make_tokens(n, seed=70 + i) for i, n in enumerate(lengths)]
    return tokens, kit.assign_blocks(lengths, BLOCK, LAYOUT.num_blocks, seed=7)


def _calls(kit, tokens, blocks):
    """``(live rows, prefill arguments)`` of each step: every row's k-th step in one call."""
    for k in range(max(len(c) for c in CUTS.values())):
        live = [row for row, cuts in CUTS.items() if k < len(cuts)]
        ends = [CUTS[row][k] for row in live]
        starts = [CUTS[row][k - 1] if k else 0 for row in live]
        matrix = kit.token_matrix([tokens[row] for row in live])
        yield live, (matrix, kit.page_table([blocks[row] for row in live]), ends, starts)


@pytest.fixture(scope="module")
def executor(tiny_model, kit, rows):
    """A traced executor over its own pool, warmed up for exactly the programs the steps use."""
    runtime = kit.build_runtime(tiny_model, num_blocks=LAYOUT.num_blocks, block_size=BLOCK, policy=POLICY)
    runtime.configure_page_table_layout(LAYOUT)
    manifest = WarmupManifest()
    for _, call in _calls(kit, *rows):
        manifest = manifest.observe(runtime.prepare(*call).requests)
    executor = PrefillExecutor(runtime)
    executor.warm_up(manifest)
    yield executor
    executor.close()


def _stepwise(prefill, kit, tokens, blocks) -> list[list[torch.Tensor]]:
    """Logits after each step of every row."""
    out = [[] for _ in tokens]
    for live, call in _calls(kit, tokens, blocks):
        for row, result in zip(live, prefill(*call)):
            out[row].append(result.logits)
    return out


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_steps_ending_inside_blocks_equal_the_one_shot_prefill(tiny_model, kit, oracle, rows, executor, traced):
    """Each step's last-token logits equal a one-shot prefill of its prefix and transformers (1e-4); so does the KV."""
    tokens, blocks = rows
    if traced:
        runtime = executor.runtime
        kit.randomize_pool(runtime.config.kv, seed=3)

        def prefill(*args):
            return executor.prefill(*args, mode="traced")
    else:
        runtime = kit.build_runtime(tiny_model, num_blocks=LAYOUT.num_blocks, block_size=BLOCK, policy=POLICY)
        kit.randomize_pool(runtime.config.kv, seed=3)
        prefill = runtime.prefill
    stepwise = _stepwise(prefill, kit, tokens, blocks)
    one_shot = kit.build_runtime(tiny_model, num_blocks=LAYOUT.num_blocks, block_size=BLOCK, policy=POLICY)
    for row, cuts in CUTS.items():
        for end, logits in zip(cuts, stepwise[row]):
            (expected,) = one_shot.prefill(tokens[row][:end][None], kit.page_table([blocks[row]]), [end])
            assert kit.max_abs_diff(logits, expected.logits) <= kit.TOL, (row, end)
            assert kit.max_abs_diff(logits, oracle.logits(tokens[row][:end])) <= kit.TOL, (row, end)
        keys, values = oracle.kv(tokens[row])
        for layer in range(len(keys)):
            k, v = kit.row_kv(runtime.config.kv, layer, blocks[row], cuts[-1])
            assert kit.max_abs_diff(k, keys[layer]) <= kit.TOL and kit.max_abs_diff(v, values[layer]) <= kit.TOL
