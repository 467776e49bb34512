"""Torch reference model: a paged-KV Llama-shaped decoder that implements the model protocol.

One model, configured from the checkpoint, computes the Llama, Mistral,
Qwen2 and Qwen3 families. It loads Hugging Face checkpoints from a local
folder or a GGUF file and is checked against ``transformers`` on the same
weights. Gemma 3's text decoder (``gemma3.py``) and windowed configs run as
a hybrid model (``hybrid.load_hybrid_folder``); ``load_model_folder`` picks
the plain or the hybrid model for any supported folder.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch

from prefill_shell.reference.llama_like.config import LayerAttention, LlamaSpec, read_config_json
from prefill_shell.reference.llama_like.llama import PagedLlama
from prefill_shell.reference.llama_like.rope import LinearRopeScaling, Llama3RopeScaling, YarnRopeScaling
from prefill_shell.reference.loading.gguf import load_gguf
from prefill_shell.reference.loading.model_folder import load_model_folder
from prefill_shell.reference.loading.weights import PRESETS, load_hf_folder, random_llama, save_hf_folder
from prefill_shell.reference.pools.kv_cache import PagedKVCache

__all__ = [
    "PRESETS",
    "LayerAttention",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "LlamaSpec",
    "PagedKVCache",
    "PagedLlama",
    "load_gguf",
    "load_hf_folder",
    "load_model_folder",
    "random_llama",
    "read_config_json",
    "save_hf_folder",
    "YarnRopeScaling",
]
