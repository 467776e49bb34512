"""Hybrid models on the reference Llama against transformers: sliding windows through chunks and cached prefixes.

The oracles are transformers' own ``MistralForCausalLM`` (every layer slides)
and ``MinistralForCausalLM`` (``layer_types`` mixing sliding and full layers,
the Llama architecture otherwise) on the reference model's random weights
(``window_kit``). A prompt is prefilled in two calls, as vLLM sends it: a
first call computes a prefix; the caller then frees the blocks that left the
window at vLLM's line (``remove_skipped_blocks``), which here fills them with
NaN and points their table entries at the NaN-filled null block or at blocks
of another live request; a second call computes the rest from the cached
offset in padded chunks (``prepare_grouped``, then ``forward_grouped`` on each
step's per-group tables). Checked: last-token logits and the in-window KV
within 1e-4 of transformers, the null block and the other request's blocks
byte-identical, and every block id a gather or a fill touches inside the
group's kept columns.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PageTableLayout, PrefillBatch, prepare_grouped
from prefill_core.kv_groups.windows import kept_columns
from prefill_core.values.intmath import ceil_div
from prefill_shell.reference import save_hf_folder
from prefill_shell.reference.windows.hybrid import load_hybrid_folder
from prefill_shell.reference.windows.windowed import GroupedKVCache, GroupTensors, forward_grouped
from tests import window_kit as kit

pytest.importorskip("transformers")

POOL = 160


def _run_call(model, kv, attention, layout, tokens, lengths, cached, tables):
    """Plans one call and runs every step; returns each row's last-token logits (caller order)."""
    n = len(lengths)
    batch = PrefillBatch(tuple(lengths), tuple(cached), tuple(range(n)), tables[0], (None,) * n)
    logits = {}
    for grouped in prepare_grouped(batch, kit.POLICY, layout, attention, tables, null_block=kit.NULL):
        request = grouped.request
        for index in range(request.num_chunks):
            chunk = request.chunk(index)
            step = torch.zeros(request.padded_batch, chunk.length, dtype=torch.int64)
            for b, row in enumerate(request.source_rows):
                piece = tokens[row][chunk.start : min(chunk.end, lengths[row])]
                step[b, : len(piece)] = piece
            start = torch.full((request.padded_batch,), chunk.start, dtype=torch.int64)
            staged = [GroupTensors.of(t) for t in grouped.step_tables(index)]
            hidden = forward_grouped(model, step, start, staged, kv)
            if chunk.is_final:
                for b, row in enumerate(request.source_rows):
                    logits[row] = model.lm_head(hidden[b, lengths[row] - 1 - chunk.start][None])[0]
    return [logits[row] for row in range(n)]


def _record_touches(kv) -> list[set[int]]:
    """Per group, every block id a gather or a fill of the pool reads or writes from now on (-1 aside)."""
    touched: list[set[int]] = [set() for _ in kv.pools]
    for g, pool in enumerate(kv.pools):

        def gather(layer, table, _seen=touched[g], _inner=pool.gather):
            _seen.update(table.flatten().tolist())
            return _inner(layer, table)

        def fill(layer, k, v, table, _pool=pool, _seen=touched[g], _inner=pool.fill):
            _seen.update(b for b in table[:, : k.shape[2] // _pool.block_size].flatten().tolist() if b >= 0)
            return _inner(layer, k, v, table)

        pool.gather, pool.fill = gather, fill
    return touched


def check_in_window_kv(kv, rows, hf_kv, length: int, window: int) -> None:
    """Each layer's KV at the positions transformers keeps (and the window sees) equals it within 1e-4."""
    for layer in range(len(hf_kv)):
        pool, local, group, g = kv.of_layer(layer)
        hf_k, hf_v = hf_kv[layer]
        offset = length - hf_k.shape[1]  # a sliding layer's cache keeps only the last positions
        first = max(offset, length - (window - 1) if group.is_sliding else 0)
        for p in range(first, length):
            block, slot = rows[g][p // group.block_size], p % group.block_size
            assert torch.allclose(pool.keys[local][block, :, slot], hf_k[:, p - offset], rtol=kit.TOL, atol=kit.TOL), (
                layer,
                p,
            )
            assert torch.allclose(pool.values[local][block, :, slot], hf_v[:, p - offset], rtol=kit.TOL, atol=kit.TOL)


CASES = [
    # kind, window, sliding block size, prompt length, cached offset, out-of-window entries
    ("mistral", 40, 16, 150, 64, "null"),
    ("mistral", 17, 16, 200, 96, "other"),
    ("ministral", 24, 8, 130, 50, "null"),
    ("ministral", 33, 16, 190, 112, "other"),
    ("ministral", 16, 16, 97, 80, "other"),
    ("mistral", 32, 16, 140, 63, "other"),  # vLLM frees column 1, which a recompute from 48 would read
    ("ministral", 2, 8, 90, 50, "null"),  # position 48 left the window: its block is rewritten with its bytes
    ("qwen3", 20, 16, 160, 77, "other"),  # group 0 full, Q/K norms
    ("qwen3", 40, 8, 120, 64, "null"),
]


@pytest.mark.parametrize(("kind", "window", "sliding_bs", "length", "cached", "outside"), CASES)
def test_a_prompt_cached_past_its_window_equals_transformers(kind, window, sliding_bs, length, cached, outside):
    """Two calls over NaN-filled freed blocks and foreign entries: logits and in-window KV equal transformers."""
    model, hf, types = kit.model_and_oracle(kind, window)
    attention = kit.attention_of(types, window, sliding_bs)
    layout = PageTableLayout(16, 32, POOL)
    kv = GroupedKVCache(attention, POOL, model.spec.num_kv_heads, model.spec.head_dim)
    for pool in kv.pools:  # the null block is NaN: reading it anywhere would show
        for tensor in pool.keys + pool.values:
            tensor[kit.NULL] = float("nan")
    gen = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, model.spec.vocab_size, (length,), generator=gen)
    other = torch.randint(0, model.spec.vocab_size, (120,), generator=gen)
    tables = kit.fresh_tables(attention, [length, 120])
    _run_call(model, kv, attention, layout, [other], [120], [0], tuple((t[1],) for t in tables))
    fixed = {b: kv.block_bytes(b) for t in tables for b in t[1]} | {kit.NULL: kv.block_bytes(kit.NULL)}
    prefix = tuple((t[0][: ceil_div(cached, g.block_size)],) for t, g in zip(tables, attention.groups))
    _run_call(model, kv, attention, layout, [prompt], [cached], [0], prefix)
    rows = kit.free_left_window(kv, attention, [t[0] for t in tables], [t[1] for t in tables], cached, outside)
    touched = _record_touches(kv)
    (logits,) = _run_call(model, kv, attention, layout, [prompt], [length], [cached], tuple((r,) for r in rows))
    for g, group in enumerate(attention.groups):
        own = {rows[g][c] for c in kept_columns(length, cached, group.window, group.block_size)}
        assert touched[g] and touched[g] <= own, (g, sorted(touched[g] - own))
    expected, hf_kv = kit.hf_logits_and_kv(hf, prompt)
    assert torch.allclose(logits, expected, rtol=kit.TOL, atol=kit.TOL), (logits - expected).abs().max()
    for block, before in fixed.items():
        assert torch.equal(kv.block_bytes(block), before), f"block {block} (null or the other request's) changed"
    check_in_window_kv(kv, rows, hf_kv, length, window)


@pytest.mark.parametrize("kind", ["mistral", "qwen3"])
def test_a_windowed_hf_folder_loads_as_its_hybrid_model(kind, tmp_path):
    """``load_hybrid_folder`` reads the window and sliding layers as transformers does; logits equal its model's."""
    import json

    import transformers

    base, _, types = kit.model_and_oracle(kind, 24)
    folder = save_hf_folder(base, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window"] = 24
    if kind == "qwen3":
        cfg.update(use_sliding_window=True, layer_types=list(types))
    else:  # the kit's Mistral is the Llama architecture: name it Mistral, whose window slides every layer
        cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (folder / "config.json").write_text(json.dumps(cfg))
    model = load_hybrid_folder(folder, block_size=16, sliding_block_size=8)
    by_layer = {layer: g.kind.value for g in model.attention.groups for layer in g.layers}
    assert [by_layer[i] for i in range(len(types))] == list(types)
    assert all(g.window == (24 if g.is_sliding else None) for g in model.attention.groups)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.randint(0, base.spec.vocab_size, (100,), generator=torch.Generator().manual_seed(1))
    kv = model.new_kv_cache(POOL)
    tables = kit.fresh_tables(model.attention, [100])
    (logits,) = _run_call(model.model, kv, model.attention, PageTableLayout(16, 32, POOL), [prompt], [100], [0], tables)
    expected, _ = kit.hf_logits_and_kv(hf, prompt)
    assert torch.allclose(logits, expected, rtol=kit.TOL, atol=kit.TOL), (logits - expected).abs().max()


GEMMA3_CASES = [
    # Gemma 3 (scaled embeddings, (1 + w) norms, per-type RoPE, logit cap): sliding block 8 and 16, both outsides
    ("gemma3", 24, 8, 130, 50, "null"),
    ("gemma3", 33, 16, 190, 112, "other"),
]


@pytest.mark.parametrize(("kind", "window", "sliding_bs", "length", "cached", "outside"), GEMMA3_CASES)
def test_a_gemma3_prompt_cached_past_its_window_equals_transformers(kind, window, sliding_bs, length, cached, outside):
    """Gemma 3 through the same two calls: logits and in-window KV equal ``Gemma3ForCausalLM``'s."""
    test_a_prompt_cached_past_its_window_equals_transformers(kind, window, sliding_bs, length, cached, outside)
