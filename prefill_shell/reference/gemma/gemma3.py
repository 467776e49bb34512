"""``PagedGemma3``: Gemma 3's text decoder over per-group paged KV pools, with transformers' numerics.

What it computes beyond the reference Llama (transformers' ``modeling_gemma3``):

- embeddings scaled by ``sqrt(hidden_size)``, that scale rounded to the
  embedding dtype first;
- RMSNorm scaling by ``(1 + w)``, multiplied in float32 before rounding back
  (Llama rounds first), and four of them per layer: before and after
  attention, before and after the MLP (the "after" ones normalise the
  branch's output before the residual add);
- per-head RMSNorms of Q and K before RoPE, RoPE with its own base (and
  scaling) per layer type, and attention scaled by
  ``query_pre_attn_scalar ** -0.5``;
- a GELU (tanh approximation) gated MLP, and a tanh cap on the logits when
  the config has ``final_logit_softcapping``.

Every Gemma 3 has sliding layers, so it runs only as a hybrid model:
``body`` is the decoder, and its caller's attention (``windowed.py`` for
padded steps, ``packed_windowed.py`` for packed ones: the window rule, the
gathers and the zeroing the Llama hybrid uses) reads and writes through
the tables of each layer's KV group. Weights are plain tensors keyed by ``Gemma3ForCausalLM``'s
names; ``text_weights`` maps the multimodal checkpoints' names onto them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefill_core.values.errors import PrefillConfigError
from prefill_shell.reference.gemma.gemma3_config import Gemma3Spec
from prefill_shell.reference.llama_like.llama import _apply_rope, _expand_kv
from prefill_shell.reference.llama_like.projection import Projection
from prefill_shell.reference.llama_like.rope import rope_inv_freq

__all__ = ["PagedGemma3", "gemma3_weight_shapes", "text_weights"]

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_TEXT_PREFIXES = (  # (checkpoint prefix, Gemma3ForCausalLM prefix), first match wins
    ("language_model.model.", "model."),  # Gemma3ForConditionalGeneration as published (transformers 4)
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),  # as transformers >= 4.52 saves it
)


def gemma3_weight_shapes(spec: Gemma3Spec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must provide, by ``Gemma3ForCausalLM`` name, with its shape."""
    h, inter, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        for norm in _NORMS:
            shapes[p + f"{norm}.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def text_weights(weights: Mapping[str, torch.Tensor], nested: bool) -> dict[str, torch.Tensor]:
    """The text decoder's tensors under ``Gemma3ForCausalLM`` names.

    A nested (``gemma3``) checkpoint's ``language_model.`` names are mapped
    and its vision tower and projector dropped: this is the text model.
    """
    out = {}
    for name, tensor in weights.items():
        if nested and name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES if nested else ():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = tensor
    return out


def _norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalised in float32, times ``scale = 1 + w`` (float32), then rounded to ``x``'s dtype."""
    if x.dtype == torch.float32 and scale.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), scale, eps)
    x32 = x.float()
    return (x32 * x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_() * scale).to(x.dtype)


class _Layer(NamedTuple):
    kind: str  # transformers' layer type: its RoPE and its window
    qkv: Projection  # [q_out + 2 * kv_out, hidden]
    qk_scale: torch.Tensor  # [heads + kv_heads, head_dim] float32: 1 + q_norm per query head, then 1 + k_norm
    o: Projection
    norms: tuple[torch.Tensor, ...]  # 1 + w (float32) of _NORMS, in that order
    gate: Projection
    up: Projection
    down: Projection


class PagedGemma3:
    """Gemma 3's text decoder; a hybrid model's body (wrap it in ``HybridLlama`` to run it)."""

    def __init__(self, config: Gemma3Spec, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu"):
        self.config = config
        self.spec = config.model_spec()
        self.dtype: torch.dtype = getattr(torch, config.dtype)
        self.device = torch.device(device)
        self.weights = self._checked_weights(weights)
        w = self.weights
        self._embed = w["model.embed_tokens.weight"]
        # transformers keeps sqrt(hidden) as a float32 buffer and rounds it to the embedding dtype
        self._embed_scale = torch.tensor(config.hidden_size**0.5).to(self.dtype)
        self._layers = [self._layer(i) for i in range(config.num_layers)]
        self._final_norm = 1.0 + w["model.norm.weight"].float()
        self._head = Projection(w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"])
        self._scale = config.query_pre_attn_scalar**-0.5
        self._rope = {kind: self._rope_tables(kind) for kind in set(config.layer_types)}

    def _checked_weights(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        expected = gemma3_weight_shapes(self.config)
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise PrefillConfigError(f"checkpoint lacks {len(missing)} tensors, first: {missing[0]}")
        extra = sorted(set(weights) - set(expected) - {"lm_head.weight"})
        if extra:
            raise PrefillConfigError(f"checkpoint tensor {extra[0]!r} is unsupported: Gemma 3's text model has none")
        if self.config.tie_word_embeddings and "lm_head.weight" in weights:
            if not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]):
                raise PrefillConfigError(
                    "checkpoint tensor 'lm_head.weight' is unsupported: the config ties the head to the embeddings "
                    "but this head differs from them"
                )
        out = {}
        for name, shape in expected.items():
            tensor = weights[name]
            if tuple(tensor.shape) != shape:
                raise PrefillConfigError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
            out[name] = tensor.to(device=self.device, dtype=self.dtype).contiguous()
        return out

    def _layer(self, i: int) -> _Layer:
        p, w, config = f"model.layers.{i}.", self.weights, self.config
        qkv = torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        q_norm, k_norm = w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"]
        qk = torch.cat((q_norm.expand(config.num_heads, -1), k_norm.expand(config.num_kv_heads, -1)))
        return _Layer(
            kind=config.layer_types[i],
            qkv=Projection(qkv),
            qk_scale=1.0 + qk.float(),
            o=Projection(w[p + "self_attn.o_proj.weight"]),
            norms=tuple(1.0 + w[p + f"{n}.weight"].float() for n in _NORMS),
            gate=Projection(w[p + "mlp.gate_proj.weight"]),
            up=Projection(w[p + "mlp.up_proj.weight"]),
            down=Projection(w[p + "mlp.down_proj.weight"]),
        )

    def _rope_tables(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` ``[max_position, head_dim]`` float32 for layers of ``kind`` (see ``PagedLlama``)."""
        theta, scaling = self.config.rope_of(kind)
        inv_freq = rope_inv_freq(theta, self.config.head_dim, scaling)
        freqs = torch.outer(torch.arange(self.config.max_position_embeddings, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        factor = 1.0 if scaling is None else scaling.attention_factor  # YaRN's; 1 otherwise
        half = angles.shape[-1] // 2
        sin = angles.sin() * factor
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return (angles.cos() * factor).to(self.device), signed.to(self.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights by ``Gemma3ForCausalLM`` name."""
        return dict(self.weights)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        """Grouped-query SDPA scaled by ``query_pre_attn_scalar ** -0.5`` (``windowed_attention`` calls it)."""
        groups = self.spec.num_heads // self.spec.num_kv_heads
        if self.device.type == "cpu":
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1, scale=self._scale, **kwargs)
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
        return F.scaled_dot_product_attention(q, k, v, scale=self._scale, **kwargs)

    def _qkv(self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor):
        """``x [B, S, H]`` -> ``q [B, heads, S, D]``, ``k, v [B, kv_heads, S, D]``: Q/K normed, then rotated."""
        heads, kv_heads, dim = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        qkv = layer.qkv(x)
        qk = _norm(
            qkv[..., : (heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim)),
            layer.qk_scale,
            self.config.rms_norm_eps,
        )
        cos, sin = (t[positions].to(self.dtype).unsqueeze(2) for t in self._rope[layer.kind])  # [B, S, 1, D]
        qk = _apply_rope(qk, cos, sin)
        v = qkv[..., (heads + kv_heads) * dim :].unflatten(-1, (kv_heads, dim))
        return qk[..., :heads, :].transpose(1, 2), qk[..., heads:, :].transpose(1, 2), v.transpose(1, 2)

    def body(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The decoder over ``tokens [B, S]`` at ``positions [B, S]``; ``attend(layer, q, k, v)`` (``q [B, H, S,
        D]``, ``k, v [B, Hkv, S, D]``, normed and rotated) is each layer's attention. Returns hidden ``[B, S, H]``."""
        eps = self.config.rms_norm_eps
        batch, seq = tokens.shape
        positions = positions.clamp(max=self.config.max_position_embeddings - 1)  # padded tails feed no real query
        residual = (F.embedding(tokens, self._embed) * self._embed_scale).view(batch * seq, -1)
        for i, layer in enumerate(self._layers):
            pre_attn, post_attn, pre_mlp, post_mlp = layer.norms
            q, k, v = self._qkv(layer, _norm(residual, pre_attn, eps).view(batch, seq, -1), positions)
            attn = layer.o(attend(i, q, k, v).transpose(1, 2).reshape(batch * seq, -1))
            residual = residual + _norm(attn, post_attn, eps)
            x = _norm(residual, pre_mlp, eps)
            mlp = layer.down(F.gelu(layer.gate(x), approximate="tanh") * layer.up(x))
            residual = residual + _norm(mlp, post_mlp, eps)
        return _norm(residual, self._final_norm, eps).view(batch, seq, -1)

    @torch.inference_mode()
    def lm_head(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]``, tanh-capped in the model dtype as transformers does."""
        logits = self._head(hidden_rows.to(self.dtype))
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
