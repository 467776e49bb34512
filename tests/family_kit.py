"""Random checkpoints of the Qwen2, Qwen3 and Mistral families built by transformers, and their oracle.

Each checkpoint comes from transformers' own config class (``Qwen2Config``,
``Qwen3Config``, ``MistralConfig``) and model class, with every parameter
redrawn from a seeded normal distribution: transformers initialises biases to
zero and norm weights to one, which would leave a missed bias or Q/K norm
invisible. The shapes exercise what differs between families: grouped-query
attention, odd vocabulary sizes, tied and untied heads, a head dimension
other than hidden / heads, and three RoPE kinds (plain, yarn with its
attention factor, linear).
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    # Qwen2: q/k/v biases, tied head (as the small Qwen2.5 models), hidden / heads head_dim.
    "qwen2": dict(
        vocab_size=263, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim 24 != 64 / 4, yarn RoPE with its attention factor, untied.
    "qwen3": dict(
        vocab_size=301,
        head_dim=24,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "rope_theta": 1e6,
        },
    ),
    # Mistral: no biases, head_dim 32 != 64 / 4, linear RoPE, no window (sliding windows are the next issue's).
    "mistral": dict(
        vocab_size=277,
        head_dim=32,
        sliding_window=None,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
}
CLASSES = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


def hf_config(family: str, **overrides):
    """The family's transformers config at the tiny shapes (``overrides`` replace any field)."""
    import transformers

    cls = getattr(transformers, f"{CLASSES[family]}Config")
    return cls(**{**COMMON, **FAMILIES[family], **overrides})


def randomize(model, seed: int) -> None:
    """Redraws every parameter: matrices fan-in scaled, biases small, norm weights near one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 2:
                param.copy_(noise / param.shape[1] ** 0.5)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(1.0 + 0.1 * noise)


def family_checkpoint(family: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Saves a randomized ``*ForCausalLM`` of ``family`` into ``folder`` (float32 weights); returns the folder."""
    import transformers

    cls = getattr(transformers, f"{CLASSES[family]}ForCausalLM")
    model = cls(hf_config(family, **overrides)).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return folder


def hf_model(folder: Path, dtype: torch.dtype):
    """transformers' model loaded from ``folder`` in ``dtype`` (the oracle)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


class FamilyOracle:
    """One unpadded row through transformers: every position's logits and the per-layer KV, memoized."""

    def __init__(self, hf):
        self.hf = hf
        self._memo: dict[tuple[int, ...], tuple[torch.Tensor, list, list]] = {}

    def run(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """``(logits [len, V] float32, keys, values)``; keys and values ``[H_kv, len, D]`` per layer."""
        key = tuple(tokens.tolist())
        if key not in self._memo:
            with torch.no_grad():
                out = self.hf(tokens[None], use_cache=True)
            cache = out["cache"] if "cache" in out else out["past_key_values"]
            keys = [layer.keys[0].clone() for layer in cache.layers]
            values = [layer.values[0].clone() for layer in cache.layers]
            self._memo[key] = (out.logits[0].float().clone(), keys, values)
        return self._memo[key]


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """``max|ours - theirs| / max|theirs|``: the per-tensor relative measure the oracle tests bound."""
    theirs = theirs.float()
    return ((ours.float() - theirs).abs().max() / theirs.abs().max()).item()
