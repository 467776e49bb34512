"""Values a step must not read never reach an output or a written block (DESIGN invariant 16).

A serving engine recycles pool blocks with stale contents, and fp16 overflow
leaves inf behind. These tests fill every block a step must not read (filler
block 0, other rows' blocks, the row's own not-yet-written blocks, the sink)
with NaN, inf or huge finite values and compare against a run on a clean
pool: through the runtime's public API and through ``forward_hidden``.
"""

from __future__ import annotations

import torch

from prefill_core import PrefillPolicy

BS = 32


def _poison(kv, blocks, value: float) -> None:
    """Writes ``value`` into every K and V entry of ``blocks`` in every layer."""
    ids = torch.tensor(list(blocks))
    for pool in kv.keys + kv.values:
        pool[ids] = value


def _written_layers_finite(kv, blocks) -> bool:
    ids = torch.tensor(list(blocks))
    return all(bool(pool[ids].isfinite().all()) for pool in kv.keys + kv.values)


# ---------------------------------------------------------------- issue 15 item 9 reproducers


def test_nan_in_unowned_filler_block_leaves_cached_row_logits_finite(tiny_model, oracle, kit):
    """A 33-token row cached 32 at block 32 gets the oracle's logits although filler block 0 holds NaN."""
    rt = kit.build_runtime(tiny_model, num_blocks=8, block_size=BS)
    tokens = kit.make_tokens(33, seed=90)
    table = kit.page_table([[3, 5]])
    rt.prefill(tokens[None, :32], table[:, :1], [32])  # the cached prefix, computed for real
    _poison(rt.config.kv, [0], float("nan"))
    (result,) = rt.prefill(tokens[None], table, [33], [32])
    assert kit.max_abs_diff(result.logits, oracle.logits(tokens)) <= kit.TOL
    assert _written_layers_finite(rt.config.kv, [3, 5])


def test_nan_in_own_later_block_leaves_2049_token_row_and_its_kv_finite(tiny_model, oracle, kit):
    """An uncached 2049-token row whose last block (written by chunk 2) starts as NaN gets oracle logits and KV."""
    rt = kit.build_runtime(tiny_model, num_blocks=72, block_size=BS, policy=PrefillPolicy(max_chunk_length=2048))
    tokens = kit.make_tokens(2049, seed=91)
    blocks = list(range(1, 66))
    _poison(rt.config.kv, [blocks[-1]], float("nan"))
    (result,) = rt.prefill(tokens[None], kit.page_table([blocks]), [2049])
    assert kit.max_abs_diff(result.logits, oracle.logits(tokens)) <= kit.TOL
    keys, values = oracle.kv(tokens)
    for layer in range(tiny_model.spec.num_layers):
        got_k, got_v = kit.row_kv(rt.config.kv, layer, blocks, 2049)
        assert kit.max_abs_diff(got_k, keys[layer]) <= kit.TOL, f"layer {layer} keys"
        assert kit.max_abs_diff(got_v, values[layer]) <= kit.TOL, f"layer {layer} values"
