"""Torch reference model: a paged-KV Llama that implements the model protocol.

It loads Hugging Face Llama checkpoints from a local folder or a Llama GGUF
file and is checked against ``transformers`` on the same weights.
"""

from prefill_shell.reference.config import Llama3RopeScaling, LlamaSpec, read_config_json
from prefill_shell.reference.gguf import load_gguf
from prefill_shell.reference.kv_cache import PagedKVCache
from prefill_shell.reference.llama import PagedLlama
from prefill_shell.reference.weights import PRESETS, load_hf_folder, random_llama, save_hf_folder

__all__ = [
    "PRESETS",
    "Llama3RopeScaling",
    "LlamaSpec",
    "PagedKVCache",
    "PagedLlama",
    "load_gguf",
    "load_hf_folder",
    "random_llama",
    "read_config_json",
    "save_hf_folder",
]
