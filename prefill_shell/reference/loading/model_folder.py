"""``load_model_folder``: one loader for every supported Hugging Face folder.

A serving engine hands over a folder and wants the model that computes it:
the plain ``PagedLlama`` when transformers would attend every layer fully,
the ``HybridLlama`` (KV groups) when it slides any layer (Mistral or
Qwen2/Qwen3 with a window, Gemma 3). The choice is ``config.needs_hybrid``
over the one folder reader; ``prefill_shell.serving.serving_facade`` then
picks the facade that serves either.
"""

from __future__ import annotations

from pathlib import Path

import torch

from prefill_core.values.errors import PrefillConfigError
from prefill_shell.reference.gemma.gemma3_config import Gemma3Spec
from prefill_shell.reference.llama_like.config import (
    GEMMA3_ARCHITECTURES,
    LlamaSpec,
    in_folder,
    needs_hybrid,
    read_config_dict,
    sliding_layers,
)
from prefill_shell.reference.llama_like.llama import PagedLlama
from prefill_shell.reference.loading.pooling_folder import is_pooling_folder, load_pooling_folder
from prefill_shell.reference.loading.weights import load_hf_folder
from prefill_shell.reference.windows.hybrid import HybridLlama, load_hybrid_folder

__all__ = ["PROVISIONAL_BLOCK_SIZE", "load_model_folder", "read_model_folder_spec"]

PROVISIONAL_BLOCK_SIZE = 32
"""A hybrid model's KV block until the serving engine's arrives (the facade regroups at allocation)."""


def load_model_folder(
    folder: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: str | None = None,
    block_size: int = PROVISIONAL_BLOCK_SIZE,
    sliding_block_size: int | None = None,
) -> PagedLlama | HybridLlama:
    """The folder's model: a ``HybridLlama`` where transformers slides a layer, a ``PagedLlama`` else.

    ``block_size`` and ``sliding_block_size`` are the hybrid model's KV
    blocks (ignored for a plain model, whose pool takes its block size at
    allocation). Every error is the loaders' named ``PrefillConfigError``.
    A sentence-transformers or ``*ForSequenceClassification`` folder gives
    its body (``pooling_folder.load_pooling_folder`` also returns its pooler
    and head: ``prefill_shell.pooling.PoolingRunner.from_folder``).
    """
    if is_pooling_folder(folder):
        return load_pooling_folder(folder, device=device, dtype=dtype).model
    cfg = read_config_dict(folder)
    try:
        hybrid = needs_hybrid(cfg)
    except PrefillConfigError as error:
        raise in_folder(folder, error) from None
    if hybrid:
        return load_hybrid_folder(
            folder, block_size=block_size, sliding_block_size=sliding_block_size, device=device, dtype=dtype
        )
    return load_hf_folder(folder, device=device, dtype=dtype)


def read_model_folder_spec(folder: str | Path) -> LlamaSpec | Gemma3Spec:
    """The architecture ``load_model_folder`` would build from ``folder``'s config.json, without reading weights.

    Every config it would refuse is refused here with the same named
    ``PrefillConfigError`` (so a command can check a folder, and read its
    ``dtype``, before the slow load). A windowed Llama-family config reads
    as its plain spec: the window lives in the hybrid model's attention layout.
    """
    cfg = read_config_dict(folder)
    try:
        if cfg.get("model_type") in GEMMA3_ARCHITECTURES:
            return Gemma3Spec.from_hf_dict(cfg)
        sliding_layers(cfg)  # the window keys, refused as load_hybrid_folder refuses them
        plain = {key: value for key, value in cfg.items() if key not in ("layer_types", "use_sliding_window")}
        return LlamaSpec.from_hf_dict({**plain, "sliding_window": None})
    except PrefillConfigError as error:
        raise in_folder(folder, error) from None
