"""Shared parts of the windowed-model tests: random weights beside transformers' Mistral / Ministral / Qwen3, and
vLLM's way of freeing the blocks that left a window (``remove_skipped_blocks``) with the stale ids left behind.
"""

from __future__ import annotations

import functools

import torch

from prefill_core import AttentionLayout, PrefillPolicy
from prefill_core.values.intmath import ceil_div
from prefill_shell.reference import random_llama
from prefill_shell.reference.llama_like.config import LayerAttention
from tests.core.vllm_sliding import first_kept_after

NULL = 0
"""vLLM's null block: never written; the tests fill it with NaN."""
TOL = 1e-4
POLICY = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4), lane_size=4)
"""Chunks of at most 64 tokens, so prompts of 100-200 tokens cross several chunk, block and window edges."""
ROWS = ((150, 70), (101, 37))
"""Two rows ``(length, cached)`` cached past a 24-token window at offsets inside blocks."""
LAYER_TYPES = {
    "mistral": ("sliding_attention",) * 2,  # MistralConfig.sliding_window: every layer slides
    "ministral": ("sliding_attention", "full_attention", "sliding_attention"),  # layer_types mixing both
    "qwen3": ("full_attention", "sliding_attention", "sliding_attention"),  # Qwen3 layer_types, q/k norms
    "gemma3": ("sliding_attention", "full_attention", "sliding_attention"),  # Gemma3ForCausalLM (gemma3_kit)
}


@functools.cache
def model_and_oracle(kind: str, window: int):
    """``(reference model, transformers model, layer types)`` on the same random weights (float32, plain RoPE).

    ``qwen3``: the reference model with Qwen3's per-head Q/K RMSNorms (``LayerAttention(qk_norm=True)``).
    """
    import transformers

    if kind == "gemma3":
        from tests.gemma3_kit import gemma3_and_oracle

        return gemma3_and_oracle(window)
    types = LAYER_TYPES[kind]
    extra = {"family": "qwen3", "attention": LayerAttention(qk_norm=True)} if kind == "qwen3" else {}
    model = random_llama(5, "tiny", rope_scaling=None, num_layers=len(types), **extra)
    cfg = model.config.to_hf_dict()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    common = {key: cfg[key] for key in keys}
    common.update(
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
    elif kind == "qwen3":
        config = transformers.Qwen3Config(layer_types=list(types), use_sliding_window=True, **common)
        hf = transformers.Qwen3ForCausalLM(config)
    else:
        hf = transformers.MinistralForCausalLM(transformers.MinistralConfig(layer_types=list(types), **common))
    hf.load_state_dict(model.state_dict(), strict=True)
    return model, hf.eval().float(), types


def attention_of(types, window: int, sliding_block_size: int, block_size: int = 16) -> AttentionLayout:
    return AttentionLayout.from_layer_types(
        types, sliding_window=window, block_size=block_size, sliding_block_size=sliding_block_size
    )


def fresh_tables(attention: AttentionLayout, lengths, first_id: int = 1):
    """``tables[g][row]``: disjoint consecutive blocks per group and row (one block-id space) from ``first_id``."""
    tables, next_id = [], first_id
    for group in attention.groups:
        rows = []
        for n in lengths:
            need = ceil_div(n, group.block_size)
            rows.append(tuple(range(next_id, next_id + need)))
            next_id += need
        tables.append(tuple(rows))
    return tuple(tables)


def nan_fill(kv, blocks_per_group) -> None:
    """Fills ``blocks_per_group[g]`` with NaN in every layer of group g's pool."""
    for pool, blocks in zip(kv.pools, blocks_per_group):
        for tensor in pool.keys + pool.values:
            for block in blocks:
                tensor[block] = float("nan")


def free_left_window(kv, attention, rows, others, cached: int, outside: str):
    """vLLM after ``cached`` positions: a sliding group's blocks before its floor are freed (NaN here), and
    their table entries point at the null block (``outside="null"``) or at ``others``' blocks (stale ids of
    blocks another live request now holds). Returns each group's new row."""
    new, freed = [], []
    for group, row, other in zip(attention.groups, rows, others):
        row = list(row)
        stop = first_kept_after(cached, group.window, group.block_size) if group.is_sliding else 0
        freed.append([row[c] for c in range(stop)])
        for column in range(stop):
            row[column] = NULL if outside == "null" else other[column % len(other)]
        new.append(tuple(row))
    nan_fill(kv, freed)
    return tuple(new)


def hf_logits_and_kv(hf, tokens: torch.Tensor):
    """transformers' last-token logits and per-layer ``(keys, values)`` ``[H_kv, kept, D]`` of the cache it keeps."""
    with torch.no_grad():
        out = hf(tokens[None], use_cache=True)
    return out.logits[0, -1], [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
