"""Loading a GGUF file (llama.cpp's format) of a computed family into ``PagedLlama``.

Theory of operation
-------------------
* ``general.architecture`` is ``llama``, ``qwen2`` or ``qwen3``; anything
  else is refused. As transformers does, a ``llama`` file whose
  ``general.name`` is ``mistral`` is read as Mistral (and so gets Mistral's
  default 4096-token sliding window, refused unless the context is no
  longer). The ``ARCH.*`` metadata becomes the ``config.json`` keys
  transformers maps it to, and ``LlamaSpec.from_hf_dict`` reads them, so the
  families' defaults and refusals are the same as for a folder; a qwen2/qwen3
  head dimension comes from ``ARCH.attention.key_length`` where the file has
  it (llama.cpp writes it), else from the family's default. A file with RoPE
  scaling is refused (GGUF stores Llama-3 scaling as a precomputed
  ``rope_freqs`` tensor, not as the parameters ``LlamaSpec`` holds).
* Every tensor is dequantized to float32 with the ``gguf`` package's own
  kernels (F32, F16, BF16, the legacy and K-quants and the rest it knows),
  then cast to the requested dtype. A type the package cannot dequantize is
  refused by name.
* GGUF lists a tensor's dimensions fastest-first (``[576, 49152]`` for an
  embedding of 49152 rows), so shapes are reversed into torch order.
* Converters reorder each head's Q and K rows of ``llama``-architecture files
  (Mistral's included) from HF's half-split RoPE pairs ``(i, i + D/2)`` to
  llama.cpp's interleaved pairs ``(2i, 2i + 1)``; the loader puts them back
  so the HF-named weights mean what HF means. ``qwen2`` and ``qwen3`` files
  are written unpermuted (llama.cpp runs them with half-split RoPE), and
  transformers reads them as they are: so does this loader.
* A file without ``output.weight`` ties the LM head to the embeddings.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefill_core.values.errors import PrefillConfigError
from prefill_shell.extras import requires_extra
from prefill_shell.reference.llama_like.config import FAMILIES, LlamaSpec
from prefill_shell.reference.llama_like.llama import PagedLlama

__all__ = ["gguf_has_tokenizer", "gguf_spec", "load_gguf", "unpermute_rope_rows"]

_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_PERMUTED = "llama"  # the one architecture whose converters interleave Q/K rows

# GGUF tensor names (after ``blk.N.``) -> HF names (after ``model.layers.N.``).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gguf():
    with requires_extra("text", "reading a GGUF file"):
        import gguf
    return gguf


def _field_value(field: Any) -> Any:
    """A scalar metadata value (number, bool or string) as a Python value."""
    gguf = _gguf()
    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()  # a float32 value stays exactly the stored float32


def _metadata(reader: Any, path: Path) -> dict[str, Any]:
    gguf = _gguf()
    out = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            out[key] = _field_value(field)
    arch = out.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise PrefillConfigError(
            f"{path}: general.architecture={arch!r} is unsupported: only {_ARCHITECTURES} GGUF files load"
        )
    return out


def _family(meta: dict[str, Any]) -> str:
    """The HF ``model_type`` transformers gives the file: its architecture, or Mistral by name."""
    arch = meta["general.architecture"]
    return "mistral" if arch == "llama" and meta.get("general.name") == "mistral" else arch


def gguf_spec(meta: dict[str, Any], tensor_names: set[str], vocab_rows: int, dtype: str, path: Path) -> LlamaSpec:
    """The ``LlamaSpec`` a GGUF's metadata describes, read through the ``config.json`` keys it maps to."""
    arch = meta["general.architecture"]

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise PrefillConfigError(f"{path}: metadata lacks required field {arch}.{key}")
        return meta[f"{arch}.{key}"]

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise PrefillConfigError(f"{path}: RoPE scaling ({scaling!r}, rope_freqs) is unsupported in GGUF files")
    heads = int(need("attention.head_count"))
    cfg: dict[str, Any] = {
        "model_type": _family(meta),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", vocab_rows)),
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "dtype": dtype,
    }
    head_key = "rope.dimension_count" if arch == _PERMUTED else "attention.key_length"
    if f"{arch}.{head_key}" in meta:
        cfg["head_dim"] = int(meta[f"{arch}.{head_key}"])
    if cfg["model_type"] == "qwen3":
        # Qwen3 biases are optional (attention_bias); the file says by carrying them.
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    assert cfg["model_type"] in FAMILIES
    try:
        return LlamaSpec.from_hf_dict(cfg)
    except PrefillConfigError as error:  # name the file and say where the key came from
        message = str(error).removeprefix("config.json ")
        raise PrefillConfigError(f"{path} (as transformers reads its metadata): {message}") from None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes the converters' per-head row order: interleaved RoPE pairs back to half-split.

    Within a head of ``D`` rows, GGUF row ``2i + j`` (pair ``i``, member ``j``)
    is HF row ``j * D/2 + i``.
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise PrefillConfigError(f"{path}: tensor {name!r} has no place in the reference model")


def _dequantized(tensor: Any, path: Path) -> torch.Tensor:
    """One GGUF tensor as float32 in torch's dimension order."""
    gguf = _gguf()
    qtype = tensor.tensor_type
    try:
        values = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise PrefillConfigError(
            f"{path}: tensor {tensor.name!r} has quant type {qtype.name}, which the gguf package cannot dequantize"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions fastest-first
    # F32 data is a read-only view of the mapped file: copied only in that case.
    return torch.from_numpy(np.require(values, np.float32, ("C", "W")).reshape(shape))


def _reader(path: Path) -> Any:
    """A ``GGUFReader`` over ``path``; a missing, empty, damaged or truncated file is a named error."""
    if not path.is_file():
        raise PrefillConfigError(f"{path} does not exist: expected a .gguf file")
    stat = path.stat()
    return _parsed(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int) -> Any:
    """The parsed file, once per version of it (``size`` and ``mtime_ns`` key a rewritten file anew).

    Parsing decodes every metadata array (a 49k-token vocabulary takes
    seconds), and a command asks twice: whether the file holds a tokenizer,
    then for its weights. A failed parse is not kept.
    """
    gguf = _gguf()
    try:
        return gguf.GGUFReader(path)
    except OSError:
        raise  # unreadable: the caller's OSError handling names the path
    except Exception as error:  # the reader raises ValueError, struct and numpy errors for damaged bytes
        raise PrefillConfigError(
            f"{path} is not a readable GGUF file ({error}): re-download or re-convert it"
        ) from None


def gguf_has_tokenizer(path: str | Path) -> bool:
    """Whether a GGUF file carries the ``tokenizer.ggml.*`` metadata a tokenizer is rebuilt from."""
    return "tokenizer.ggml.model" in _reader(Path(path)).fields


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> PagedLlama:
    """A ``PagedLlama`` holding a llama, qwen2 or qwen3 GGUF file's weights, dequantized to ``dtype``.

    Raises ``PrefillConfigError`` naming the problem for a missing file, an
    architecture not computed, RoPE scaling, an unknown tensor or a quant type
    the ``gguf`` package cannot dequantize.
    """
    path = Path(path)
    reader = _reader(path)
    meta = _metadata(reader, path)
    by_name = {t.name: t for t in reader.tensors}
    embed = by_name.get("token_embd.weight")
    vocab_rows = int(embed.shape[-1]) if embed is not None else 0
    spec = gguf_spec(meta, set(by_name), vocab_rows, str(dtype).removeprefix("torch."), path)
    permuted = meta["general.architecture"] == _PERMUTED
    weights = {}
    for name, tensor in by_name.items():
        hf_name = _hf_name(name, path)
        weight = _dequantized(tensor, path)
        if permuted and hf_name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, spec.num_heads)
        elif permuted and hf_name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, spec.num_kv_heads)
        weights[hf_name] = weight.to(dtype)
    return PagedLlama(spec, weights, device=device)
