"""Random tiny checkpoints of the architectures vLLM serves with sliding windows, saved as Hugging Face folders.

Each is built with transformers' own config class, saved with
``save_pretrained`` (float32) and loaded back twice: by the project's loader
(the model behind the facade) and by transformers (the oracle), so both run
the same weights. Windows of 16 tokens at 16-token blocks slide inside
prompts of 40-130 tokens.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

WINDOW = 16
BLOCK = 16
S, F = "sliding_attention", "full_attention"
SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
ARCHITECTURES = {
    "gemma3-2to1": [S, S, F] * 2,
    "gemma3-5to1": ([S] * 5 + [F]) * 2,
    "qwen3-hybrid": [F, S],
    "mistral-sliding": [S, S],
    "llama": [F, F],
}


def _hf_model(name: str):
    import transformers

    types = ARCHITECTURES[name]
    common = dict(SIZES, num_hidden_layers=len(types))
    torch.manual_seed(sum(map(ord, name)))
    if name.startswith("gemma3"):
        config = transformers.Gemma3TextConfig(**common, layer_types=types, sliding_window=WINDOW)
        return transformers.Gemma3ForCausalLM(config)
    if name == "qwen3-hybrid":
        config = transformers.Qwen3Config(**common, layer_types=types, use_sliding_window=True, sliding_window=WINDOW)
        return transformers.Qwen3ForCausalLM(config)
    if name == "mistral-sliding":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=WINDOW))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


@functools.cache
def checkpoint(name: str) -> tuple[Path, object]:
    """``(folder, transformers model loaded from it)`` for one architecture (built once per session)."""
    import transformers

    folder = Path(tempfile.mkdtemp(prefix=f"vllm-{name}-"))
    _hf_model(name).float().save_pretrained(folder)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, oracle


def project_model(name: str):
    """The project's model on the folder: ``HybridLlama`` where a layer slides, the plain reference Llama else."""
    from prefill_shell.reference.loading.weights import load_hf_folder
    from prefill_shell.reference.windows.hybrid import load_hybrid_folder

    folder, _ = checkpoint(name)
    if S in ARCHITECTURES[name]:
        return load_hybrid_folder(folder, block_size=BLOCK)
    return load_hf_folder(folder)
