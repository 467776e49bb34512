"""Fixtures of the shell's tests: the tiny model, its HF oracle and the real SmolLM2 (helpers: tests/helpers.py).

Registered for every folder by ``tests/conftest.py``, so each session-scoped value is built once per run.

The oracle is ``transformers.LlamaForCausalLM`` loaded in float32 from the
very weights the reference model holds; each row is run through it alone,
unpadded, so every runtime result is compared with an independent answer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from prefill_shell.reference import random_llama, save_hf_folder
from prefill_shell.reference.gguf import load_gguf
from prefill_shell.reference.smollm2 import ENV_VAR, ModelFileMissingError, smollm2_path
from tests import helpers

__all__ = [
    "kit",
    "one_torch_thread",
    "oracle",
    "smollm2",
    "smollm2_file",
    "smollm2_hf",
    "smollm2_tokenizer",
    "tiny_model",
]


@pytest.fixture(scope="session")
def tiny_model():
    """The seeded tiny preset, with positions for 8192 tokens so a 5000-token row fits its capacity."""
    return random_llama(0, "tiny", max_position_embeddings=8192)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread while a module runs (modules opt in with ``usefixtures``): their many small steps pay for a
    second intra-op thread on a shared 2-core machine, where it spin-waits for a descheduled partner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def oracle(tiny_model, tmp_path_factory):
    """An ``Oracle`` over transformers' Llama holding ``tiny_model``'s weights."""
    transformers = pytest.importorskip("transformers")
    folder = save_hf_folder(tiny_model, tmp_path_factory.mktemp("tiny_hf"))
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return Oracle(hf)


class Oracle:
    """Runs one unpadded row through HF and memoizes its last-token logits and KV cache."""

    def __init__(self, hf):
        self.hf = hf
        self._memo: dict[tuple[int, ...], tuple[torch.Tensor, list, list]] = {}

    def _run(self, tokens: torch.Tensor):
        key = tuple(tokens.tolist())
        if key not in self._memo:
            with torch.no_grad():
                out = self.hf(tokens[None], use_cache=True)
            cache = out["cache"] if "cache" in out else out["past_key_values"]
            keys = [layer.keys[0].clone() for layer in cache.layers]  # [H_kv, S, D] per layer
            values = [layer.values[0].clone() for layer in cache.layers]
            self._memo[key] = (out.logits[0, -1].clone(), keys, values)
        return self._memo[key]

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 ``[V]`` logits of the row's last token."""
        return self._run(tokens)[0]

    def kv(self, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the row's post-RoPE keys and values ``[H_kv, len, D]``."""
        _, keys, values = self._run(tokens)
        return keys, values


@pytest.fixture(scope="session")
def kit():
    """tests.helpers as one fixture, kept while tests still take ``kit`` (new tests import from tests.helpers)."""
    return helpers


# -- the real SmolLM2 (its pinned GGUF) and transformers on the same file: loaded once a session ----------


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    """The pinned GGUF (sha256 checked); skipped only when nothing points at it and the cache lacks it."""
    try:
        return smollm2_path()
    except ModelFileMissingError as missing:
        if os.environ.get(ENV_VAR):
            raise
        pytest.skip(f"{missing} (make test fetches it)")


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """Our reference Llama holding the file's weights, dequantized to float32."""
    pytest.importorskip("gguf")
    return load_gguf(smollm2_file, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_file):
    """transformers' tokenizer rebuilt from the file's metadata."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_file):
    """transformers' Llama loaded from the same file (its own dequantization), float32."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_file.parent, gguf_file=smollm2_file.name, dtype=torch.float32
    ).eval()
