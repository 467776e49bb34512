"""Getting weights into and out of ``PagedLlama``: HF folders and seeded presets.

A Hugging Face Llama folder is ``config.json`` plus either one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
``save_hf_folder`` writes the single-file form with HF tensor names, so
``transformers.LlamaForCausalLM.from_pretrained`` loads the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file, save_file

from prefill_core.values.errors import PrefillConfigError
from prefill_shell.reference.llama_like.config import LlamaSpec, read_config_json
from prefill_shell.reference.llama_like.llama import PagedLlama, llama_weight_shapes, rope_inv_freq
from prefill_shell.reference.llama_like.rope import Llama3RopeScaling

__all__ = ["PRESETS", "load_hf_folder", "load_weights", "random_llama", "save_hf_folder"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"

PRESETS: dict[str, LlamaSpec] = {
    # Smallest model that still has GQA, several layers and every RoPE band.
    "tiny": LlamaSpec(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 512),
        max_position_embeddings=4096,
    ),
    # Realistic vocab and head_dim for timing the runtime, still quick on CPU.
    "bench": LlamaSpec(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 2048),
        max_position_embeddings=16384,
    ),
    # SmolLM2-135M's shape (its GGUF file's spec) with random weights: for machines the file cannot reach.
    "smollm2_shape": LlamaSpec(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # Sized so a 5000-token prefill takes about a second on two CPU cores.
    "demo": LlamaSpec(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 1024),
        max_position_embeddings=8192,
    ),
}


def random_llama(
    seed: int, preset: str = "tiny", device: torch.device | str = "cpu", **overrides: object
) -> PagedLlama:
    """A ``PagedLlama`` with seeded random weights for a named preset.

    ``overrides`` replace preset fields (e.g. ``tie_word_embeddings=True``).
    The same seed and preset always give the same weights.
    """
    if preset not in PRESETS:
        raise PrefillConfigError(f"preset={preset!r} is invalid: expected one of {sorted(PRESETS)}")
    spec = attrs.evolve(PRESETS[preset], **overrides)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in llama_weight_shapes(spec).items():
        if name.endswith(".bias"):
            weights[name] = 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            # Norm weights near 1 but not equal, so a missed norm scale shows up.
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            # Fan-in scaling keeps activations O(1) through the layers.
            weights[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    return PagedLlama(spec, weights, device=device)


def load_hf_folder(folder: str | Path, device: torch.device | str = "cpu", dtype: str | None = None) -> PagedLlama:
    """Loads a local Hugging Face Llama folder (single or sharded safetensors).

    ``dtype`` (e.g. ``"float32"``) overrides the checkpoint's stored dtype.
    """
    return load_weights(Path(folder), read_config_json(folder), device, dtype)


def load_weights(
    folder: Path, spec: LlamaSpec, device: torch.device | str = "cpu", dtype: str | None = None
) -> PagedLlama:
    """The folder's safetensors as a ``PagedLlama`` of ``spec`` (every tensor placed; ``dtype`` overrides)."""
    if dtype is not None:
        spec = attrs.evolve(spec, dtype=dtype)
    weights: dict[str, torch.Tensor] = {}
    for shard in _shard_files(folder):
        weights.update(_read_shard(shard))
    _check_tensor_names(spec, weights, folder)
    return PagedLlama(spec, weights, device=device)


def _read_shard(shard: Path) -> dict[str, torch.Tensor]:
    if not shard.is_file():
        raise PrefillConfigError(f"{shard} does not exist: the folder's {_INDEX} names it")
    try:
        return load_file(str(shard))
    except OSError:
        raise  # unreadable: the caller's OSError handling names the path
    except Exception as error:  # safetensors raises its own error type for damaged headers and short data
        raise PrefillConfigError(f"{shard} is not a readable safetensors file ({error}): re-download it") from None


def _check_tensor_names(spec: LlamaSpec, weights: dict[str, torch.Tensor], folder: Path) -> None:
    """Every checkpoint tensor has a place in the reference Llama: none is dropped unread.

    Two redundant forms are checked, not dropped: a tied checkpoint that also
    stores ``lm_head.weight`` (it must equal the embeddings) and the RoPE
    ``inv_freq`` buffers older exports saved (they must equal the computed ones).
    """
    wanted = set(llama_weight_shapes(spec))
    for name in sorted(set(weights) - wanted):
        tensor = weights.pop(name)
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            same = torch.equal(tensor, weights.get("model.embed_tokens.weight", tensor.new_empty(0)))
            rule = "the config ties the head to the embeddings but this head differs from them"
        elif name.endswith(".self_attn.rotary_emb.inv_freq"):
            expected = rope_inv_freq(spec)
            same = tensor.shape == expected.shape and torch.allclose(tensor.float(), expected, rtol=1e-5, atol=0)
            rule = "it differs from the RoPE frequencies config.json describes"
        else:
            same, rule = False, "the reference model has no such tensor (a bias or norm config.json does not describe)"
        if not same:
            raise PrefillConfigError(f"{folder}: checkpoint tensor {name!r} is unsupported: {rule}")


def _shard_files(folder: Path) -> list[Path]:
    index = folder / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise PrefillConfigError(
                f"{index} is not a safetensors index (a JSON object with a 'weight_map')"
            ) from None
        return [folder / str(name) for name in names]
    single = folder / _SINGLE
    if single.is_file():
        return [single]
    raise PrefillConfigError(f"{folder} holds neither {_SINGLE} nor {_INDEX}")


def save_hf_folder(model: PagedLlama, folder: str | Path) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` in HF Llama naming; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "config.json").open("w", encoding="utf-8") as fh:
        json.dump(model.config.to_hf_dict(), fh, indent=2, sort_keys=True)
    # safetensors rejects shared storage, and tied checkpoints omit lm_head anyway
    # (state_dict already leaves it out), so every tensor here is distinct.
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / _SINGLE), metadata={"format": "pt"})
    return folder
