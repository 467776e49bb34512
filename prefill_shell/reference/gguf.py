"""Loading a Llama GGUF file (llama.cpp's format) into ``PagedLlama``.

Theory of operation
-------------------
* The architecture comes from the file's ``llama.*`` metadata; a file whose
  ``general.architecture`` is anything else is refused, as is one with RoPE
  scaling (GGUF stores Llama-3 scaling as a precomputed ``rope_freqs``
  tensor, not as the parameters ``LlamaSpec`` holds).
* Every tensor is dequantized to float32 with the ``gguf`` package's own
  kernels (F32, F16, BF16, the legacy and K-quants and the rest it knows),
  then cast to the requested dtype. A type the package cannot dequantize is
  refused by name.
* GGUF lists a tensor's dimensions fastest-first (``[576, 49152]`` for an
  embedding of 49152 rows), so shapes are reversed into torch order.
* Converters reorder each head's Q and K rows from HF's half-split RoPE pairs
  ``(i, i + D/2)`` to llama.cpp's interleaved pairs ``(2i, 2i + 1)``; the
  loader puts them back so the HF-named weights mean what HF means.
* A file without ``output.weight`` ties the LM head to the embeddings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefill_core.errors import PrefillConfigError
from prefill_shell.extras import requires_extra
from prefill_shell.reference.config import LlamaSpec
from prefill_shell.reference.llama import PagedLlama

__all__ = ["gguf_has_tokenizer", "gguf_spec", "load_gguf", "unpermute_rope_rows"]

_ARCH = "llama"

# GGUF tensor names (after ``blk.N.``) -> HF names (after ``model.layers.N.``).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
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
    if arch != _ARCH:
        raise PrefillConfigError(
            f"{path}: general.architecture={arch!r} is unsupported: only {_ARCH!r} GGUF files load"
        )
    return out


def gguf_spec(meta: dict[str, Any], tensor_names: set[str], vocab_rows: int, dtype: str, path: Path) -> LlamaSpec:
    """The ``LlamaSpec`` a Llama GGUF's metadata describes."""

    def need(key: str) -> Any:
        if f"{_ARCH}.{key}" not in meta:
            raise PrefillConfigError(f"{path}: metadata lacks required field {_ARCH}.{key}")
        return meta[f"{_ARCH}.{key}"]

    scaling = meta.get(f"{_ARCH}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise PrefillConfigError(f"{path}: RoPE scaling ({scaling!r}, rope_freqs) is unsupported in GGUF files")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    return LlamaSpec(
        vocab_size=int(meta.get(f"{_ARCH}.vocab_size", vocab_rows)),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{_ARCH}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{_ARCH}.rope.dimension_count", hidden // heads)),
        rms_norm_eps=need("attention.layer_norm_rms_epsilon"),
        rope_theta=meta.get(f"{_ARCH}.rope.freq_base", 10000.0),
        rope_scaling=None,
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        dtype=dtype,
    )


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
    raise PrefillConfigError(f"{path}: tensor {name!r} has no place in a Llama")


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
    gguf = _gguf()
    try:
        return gguf.GGUFReader(str(path))
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
    """A ``PagedLlama`` holding a Llama GGUF file's weights, dequantized to ``dtype``.

    Raises ``PrefillConfigError`` naming the problem for a missing file, a
    non-Llama architecture, RoPE scaling, an unknown tensor or a quant type
    the ``gguf`` package cannot dequantize.
    """
    path = Path(path)
    reader = _reader(path)
    meta = _metadata(reader, path)
    by_name = {t.name: t for t in reader.tensors}
    embed = by_name.get("token_embd.weight")
    vocab_rows = int(embed.shape[-1]) if embed is not None else 0
    spec = gguf_spec(meta, set(by_name), vocab_rows, str(dtype).removeprefix("torch."), path)
    weights = {}
    for name, tensor in by_name.items():
        hf_name = _hf_name(name, path)
        weight = _dequantized(tensor, path)
        if hf_name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, spec.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, spec.num_kv_heads)
        weights[hf_name] = weight.to(dtype)
    return PagedLlama(spec, weights, device=device)
