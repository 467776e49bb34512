"""Hybrid models on the reference Llama against transformers: sliding windows through chunks and cached prefixes.

The oracles are transformers' own: ``MistralForCausalLM`` (every layer
slides) and ``MinistralForCausalLM`` (``layer_types`` mixing sliding and full
layers, the Llama architecture otherwise), holding the reference model's
random weights. A prompt is prefilled in two calls, as vLLM would send it: a
first call computes a prefix, the caller then frees the prefix's blocks that
left the window (vLLM's ``remove_skipped_blocks``), fills them with NaN and
points their table entries at the NaN-filled null block or at blocks of
another live request, and a second call computes the rest from the cached
offset in padded chunks (``prepare_grouped``, then ``forward_grouped`` on each
step's per-group tables). Checked: last-token logits and the in-window KV
within 1e-4 of transformers, and the null block and the other request's
blocks byte-identical after every call.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import AttentionLayout, PageTableLayout, PrefillBatch, PrefillPolicy, prepare_grouped
from prefill_core.computed_positions import computed_start
from prefill_core.intmath import ceil_div
from prefill_core.windows import kept_columns
from prefill_shell.reference import random_llama
from prefill_shell.reference.windowed import GroupedKVCache, GroupTensors, forward_grouped

transformers = pytest.importorskip("transformers")

TOL = 1e-4
NULL = 0
POOL = 160
POLICY = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4), lane_size=4)
LAYER_TYPES = {
    "mistral": ("sliding_attention",) * 2,
    "ministral": ("sliding_attention", "full_attention", "sliding_attention"),
}


def _model_and_oracle(kind: str, window: int):
    types = LAYER_TYPES[kind]
    model = random_llama(5, "tiny", rope_scaling=None, num_layers=len(types))
    cfg = model.config.to_hf_dict()
    common = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        rms_norm_eps=cfg["rms_norm_eps"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
        sliding_window=window,
        tie_word_embeddings=False,
    )
    if kind == "mistral":
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    else:
        hf = transformers.MinistralForCausalLM(transformers.MinistralConfig(layer_types=list(types), **common))
    hf.load_state_dict(model.state_dict(), strict=True)
    return model, hf.eval().float(), types


@pytest.fixture(scope="module")
def models():
    return {}


def _get(models, kind, window):
    if (kind, window) not in models:
        models[kind, window] = _model_and_oracle(kind, window)
    return models[kind, window]


def _run_call(model, kv, attention, layout, tokens, lengths, cached, tables):
    """Plans one call and runs every step; returns each row's last-token logits (caller order)."""
    n = len(lengths)
    batch = PrefillBatch(tuple(lengths), tuple(cached), tuple(range(n)), tables[0], (None,) * n)
    logits = {}
    for grouped in prepare_grouped(batch, POLICY, layout, attention, tables, null_block=NULL):
        request = grouped.request
        for index in range(request.num_chunks):
            chunk = request.chunk(index)
            step = torch.zeros(request.padded_batch, chunk.length, dtype=torch.int64)
            for b, row in enumerate(request.source_rows):
                piece = tokens[row][chunk.start : min(chunk.end, lengths[row])]
                step[b, : len(piece)] = piece
            start = torch.full((request.padded_batch,), chunk.start, dtype=torch.int64)
            staged = [
                GroupTensors(
                    torch.tensor(t.fill, dtype=torch.int32),
                    None if t.read is None else torch.tensor(t.read, dtype=torch.int32),
                )
                for t in grouped.step_tables(index)
            ]
            hidden = forward_grouped(model, step, start, staged, kv)
            if chunk.is_final:
                for b, row in enumerate(request.source_rows):
                    logits[row] = model.lm_head(hidden[b, lengths[row] - 1 - chunk.start][None])[0]
    return [logits[row] for row in range(n)]


def _fresh_tables(attention, lengths, first_id):
    """Disjoint consecutive blocks per group and row (one block-id space), from ``first_id``."""
    tables, next_id = [], first_id
    for group in attention.groups:
        rows = []
        for n in lengths:
            need = ceil_div(n, group.block_size)
            rows.append(tuple(range(next_id, next_id + need)))
            next_id += need
        tables.append(tuple(rows))
    return tuple(tables), next_id


def _hf_kv(hf, tokens):
    with torch.no_grad():
        out = hf(tokens[None], use_cache=True)
    cache = out.past_key_values
    return out.logits[0, -1], [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def _record_touches(kv) -> list[set[int]]:
    """Per group, every block id a gather or a fill of the pool reads or writes from now on (-1 aside)."""
    touched: list[set[int]] = [set() for _ in kv.pools]
    for g, pool in enumerate(kv.pools):

        def gather(layer, table, _pool=pool, _seen=touched[g], _inner=pool.gather):
            _seen.update(table.flatten().tolist())
            return _inner(layer, table)

        def fill(layer, k, v, table, _pool=pool, _seen=touched[g], _inner=pool.fill):
            _seen.update(b for b in table[:, : k.shape[2] // _pool.block_size].flatten().tolist() if b >= 0)
            return _inner(layer, k, v, table)

        pool.gather, pool.fill = gather, fill
    return touched


CASES = [
    # kind, window, sliding block size, prompt length, cached offset, out-of-window entries
    ("mistral", 40, 16, 150, 64, "null"),
    ("mistral", 17, 16, 200, 96, "other"),
    ("ministral", 24, 8, 130, 50, "null"),
    ("ministral", 33, 16, 190, 112, "other"),
    ("ministral", 16, 16, 97, 80, "other"),
]


@pytest.mark.parametrize(("kind", "window", "sliding_bs", "length", "cached", "outside"), CASES)
def test_a_prompt_cached_past_its_window_equals_transformers(models, kind, window, sliding_bs, length, cached, outside):
    """Two calls over NaN-filled freed blocks and foreign entries: logits and in-window KV equal transformers."""
    model, hf, types = _get(models, kind, window)
    attention = AttentionLayout.from_layer_types(
        types, sliding_window=window, block_size=16, sliding_block_size=sliding_bs
    )
    layout = PageTableLayout(16, 32, POOL)
    spec = model.spec
    kv = GroupedKVCache(attention, POOL, spec.num_kv_heads, spec.head_dim)
    for pool in kv.pools:  # the null block is NaN: reading it anywhere would show
        for t in pool.keys + pool.values:
            t[NULL] = float("nan")
    gen = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, spec.vocab_size, (length,), generator=gen)
    other = torch.randint(0, spec.vocab_size, (120,), generator=gen)
    tables, _ = _fresh_tables(attention, [length, 120], first_id=1)
    # The other live request: computed whole, its blocks then fixed.
    _run_call(model, kv, attention, layout, [other], [120], [0], tuple((t[1],) for t in tables))
    other_bytes = {b: kv.block_bytes(b) for t in tables for b in t[1]}
    null_bytes = kv.block_bytes(NULL)
    # First call: the prefix [0, cached).
    prefix = tuple((t[0][: ceil_div(cached, g.block_size)],) for t, g in zip(tables, attention.groups))
    _run_call(model, kv, attention, layout, [prompt], [cached], [0], prefix)
    # The caller frees what left the window: NaN in those blocks, null or another request's ids in the table.
    second = []
    for g, (t, group) in enumerate(zip(tables, attention.groups)):
        row, pool = list(t[0]), kv.pools[g]
        keep = kept_columns(computed_start(length, cached, 16), length, group.window, group.block_size)
        for column in range(keep.start):
            for tensor in pool.keys + pool.values:
                tensor[row[column]] = float("nan")
            row[column] = NULL if outside == "null" else t[1][column % len(t[1])]
        second.append((tuple(row),))
    touched = _record_touches(kv)
    (logits,) = _run_call(model, kv, attention, layout, [prompt], [length], [cached], tuple(second))
    for g, group in enumerate(attention.groups):
        keep = kept_columns(computed_start(length, cached, 16), length, group.window, group.block_size)
        own = {second[g][0][c] for c in keep}
        assert touched[g] and touched[g] <= own, (g, sorted(touched[g] - own))
    expected, hf_kv = _hf_kv(hf, prompt)
    assert torch.allclose(logits, expected, rtol=TOL, atol=TOL), (logits - expected).abs().max()
    assert torch.equal(kv.block_bytes(NULL), null_bytes)
    for block, before in other_bytes.items():
        assert torch.equal(kv.block_bytes(block), before), f"block {block} of the other request changed"
    for layer in range(len(types)):
        pool, local, group, g = kv.of_layer(layer)
        bs, row = group.block_size, second[g][0]
        hf_k, hf_v = hf_kv[layer]
        first = max(0, length - (window - 1 if group.is_sliding else length))
        positions = range(max(first, length - hf_k.shape[1]), length)
        for p in positions:
            block, offset = row[p // bs], p % bs
            got = pool.keys[local][block, :, offset]
            want = hf_k[:, p - (length - hf_k.shape[1])]
            assert torch.allclose(got, want, rtol=TOL, atol=TOL), (layer, p)
            assert torch.allclose(
                pool.values[local][block, :, offset], hf_v[:, p - (length - hf_k.shape[1])], rtol=TOL, atol=TOL
            )
