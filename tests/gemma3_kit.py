"""Random tiny Gemma 3 checkpoints beside transformers' own ``Gemma3ForCausalLM`` on the same weights.

Every weight is drawn afresh (transformers initialises the norms to zero,
which would leave ``1 + w`` untested), large enough that the final logit
cap of 20 bends them (uncapped they reach about 30); RoPE differs by layer type (sliding base 1e4,
full base 1e6 with linear scaling 8, as the 4B and larger checkpoints), and
``query_pre_attn_scalar`` differs from ``head_dim``.
"""

from __future__ import annotations

import functools

import torch

from prefill_shell.reference.gemma.gemma3 import PagedGemma3
from prefill_shell.reference.gemma.gemma3_config import Gemma3Spec

TYPES = ("sliding_attention", "full_attention", "sliding_attention")
SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=len(TYPES),
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    max_position_embeddings=1024,
    final_logit_softcapping=20.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    },
)


def text_config(window: int, **overrides):
    """transformers' ``Gemma3TextConfig`` of the tiny model."""
    import transformers

    return transformers.Gemma3TextConfig(**{**SIZES, "sliding_window": window, "layer_types": list(TYPES), **overrides})


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter redrawn from a seeded normal (norm weights included)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(module.named_parameters()):
            scale = 0.3 if name.endswith("norm.weight") else 0.6 if "embed_tokens" in name else 0.15
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale)


@functools.cache
def gemma3_and_oracle(window: int):
    """``(PagedGemma3, transformers' Gemma3ForCausalLM, layer types)`` on the same random weights (float32)."""
    import transformers

    config = text_config(window)
    hf = transformers.Gemma3ForCausalLM(config).eval().float()
    randomize(hf, 3)
    spec = Gemma3Spec.from_hf_dict(config.to_dict())
    weights = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    return PagedGemma3(spec, weights), hf, TYPES
