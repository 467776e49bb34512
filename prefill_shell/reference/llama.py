"""A torch Llama whose attention reads and writes a paged KV pool.

It implements ``PrefillModel`` and mirrors Hugging Face's Llama numerics
(RMSNorm in float32, half-split RoPE with Llama-3 frequency scaling, grouped
query attention, SwiGLU) so that it can be checked against ``transformers``
on the same weights. Weights are plain tensors keyed by their HF names.

Everything inside ``forward_hidden`` is capture-safe: shapes come only from
input shapes, ``start`` stays on the device, and ``-1`` page-table entries are
handled by the pool's sink block rather than by masking or branching.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefill_core.errors import PrefillConfigError
from prefill_shell.reference.config import LlamaSpec
from prefill_shell.reference.kv_cache import PagedKVCache

__all__ = ["PagedLlama", "llama_weight_shapes", "rope_inv_freq"]


class _Layer(NamedTuple):
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [q_out + 2 * kv_out, hidden]: one matmul for Q, K and V
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def llama_weight_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must provide, by HF name, with its shape.

    ``lm_head.weight`` is absent when the embeddings are tied.
    """
    h, inter = spec.hidden_size, spec.intermediate_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def rope_inv_freq(spec: LlamaSpec) -> torch.Tensor:
    """Per-pair rotation frequencies ``[head_dim // 2]`` (float32), Llama-3 scaled if configured.

    Computed in float32 like HF does, so both sides round the same way.
    """
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
    # and the band between is a linear blend so the spectrum stays continuous.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    ramp = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - ramp) * scaled / scaling.factor + ramp * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel
    # Normalise in float32 whatever the model dtype, as HF does, then scale.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, S, D]; cos/signed_sin: [B, 1, S, D]. Half-split pairs (i, i + D/2), HF's layout:
    # x*cos + cat(-x2, x1)*sin, with the minus folded into the first half of the sin table.
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, H_kv, T, D] -> [B, H_kv * groups, T, D]; query head h uses kv head h // groups.
    # expand + reshape rather than repeat_interleave: pure shape arithmetic, no
    # chance of a host sync while a CUDA graph is being captured.
    if groups == 1:
        return x
    batch, heads, seq, dim = x.shape
    return x[:, :, None].expand(batch, heads, groups, seq, dim).reshape(batch, heads * groups, seq, dim)


class PagedLlama:
    """Llama with paged KV; implements ``prefill_shell.model.PrefillModel``."""

    def __init__(self, config: LlamaSpec, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu"):
        self.config = config
        self.spec = config.model_spec()
        self.dtype: torch.dtype = getattr(torch, config.dtype)
        self.device = torch.device(device)
        self.weights = self._checked_weights(weights)
        w = self.weights
        self._layers = [self._layer(i) for i in range(config.num_layers)]
        self._embed = w["model.embed_tokens.weight"]
        self._final_norm = w["model.norm.weight"]
        self._head = w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
        freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), rope_inv_freq(config))
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        # Precomputed tables turn position handling into a gather with static shapes.
        self._cos = angles.cos().to(self.device)
        half = angles.shape[-1] // 2
        sin = angles.sin()
        self._signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.device)

    def _checked_weights(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        expected = llama_weight_shapes(self.config)
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise PrefillConfigError(f"checkpoint lacks {len(missing)} tensors, first: {missing[0]}")
        out = {}
        for name, shape in expected.items():
            tensor = weights[name]
            if tuple(tensor.shape) != shape:
                raise PrefillConfigError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
            out[name] = tensor.to(device=self.device, dtype=self.dtype).contiguous()
        return out

    def _fuse(self, names: list[str]) -> torch.Tensor:
        """Concatenates weights by rows and re-points each name at a view of the result.

        Fewer, larger matmuls run faster; the views keep ``state_dict`` (and
        so ``save_hf_folder``) in HF naming without a second copy.
        """
        fused = torch.cat([self.weights[n] for n in names])
        first = 0
        for name in names:
            rows = self.weights[name].shape[0]
            self.weights[name] = fused[first : first + rows]
            first += rows
        return fused

    def _layer(self, i: int) -> _Layer:
        p, w = f"model.layers.{i}.", self.weights
        # Q/K/V fuse profitably; gate/up do not (measured on a 2-core CPU:
        # one [2*I, H] matmul ran ~15% slower than two [I, H] ones).
        qkv = self._fuse([p + f"self_attn.{n}_proj.weight" for n in "qkv"])
        return _Layer(
            attn_norm=w[p + "input_layernorm.weight"],
            qkv=qkv,
            o=w[p + "self_attn.o_proj.weight"],
            mlp_norm=w[p + "post_attention_layernorm.weight"],
            gate=w[p + "mlp.gate_proj.weight"],
            up=w[p + "mlp.up_proj.weight"],
            down=w[p + "mlp.down_proj.weight"],
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights by HF name (shared tensors, not copies)."""
        return dict(self.weights)

    def new_kv_cache(self, num_blocks: int, block_size: int, device: torch.device | str | None = None) -> PagedKVCache:
        """A zeroed pool sized for this model."""
        spec = self.spec
        return PagedKVCache(
            spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
            dtype=self.dtype, device=self.device if device is None else device,
        )

    @torch.inference_mode()
    def forward_hidden(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        fill_table: torch.Tensor,
        read_table: torch.Tensor | None,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        """One model-body step over a padded wave; see ``PrefillModel.forward_hidden``."""
        seq = tokens.shape[1]
        if seq % kv.block_size:
            raise ValueError(f"invocation length {seq} is not a multiple of block size {kv.block_size}")
        positions = start.to(torch.int64)[:, None] + torch.arange(seq, device=tokens.device)  # [B, S]
        # Padded tails may run past the table; clamping keeps the gather in bounds
        # without a host check, and those positions never feed a real query.
        table_pos = positions.clamp(max=self.config.max_position_embeddings - 1)
        cos = self._cos[table_pos].to(self.dtype).unsqueeze(1)  # [B, 1, S, D]
        sin = self._signed_sin[table_pos].to(self.dtype).unsqueeze(1)
        mask = None
        if read_table is not None:
            key_pos = torch.arange(read_table.shape[1] * kv.block_size, device=tokens.device)
            mask = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, S, Wr*bs]
        x = F.embedding(tokens, self._embed)  # a fresh tensor: the residual stream, updated in place
        residual = x.view(-1, x.shape[-1])  # [B*S, H]
        eps = self.config.rms_norm_eps
        for i, layer in enumerate(self._layers):
            attn = self._attention(i, layer, _rms_norm(x, layer.attn_norm, eps), (cos, sin), fill_table, read_table, mask, kv)
            # Each residual add rides in its projection's GEMM (beta = 1): no
            # separate add pass and no fresh [B*S, H] buffer per add.
            residual.addmm_(attn, layer.o.t())
            residual.addmm_(self._mlp_hidden(layer, _rms_norm(x, layer.mlp_norm, eps)), layer.down.t())
        return _rms_norm(x, self._final_norm, eps)

    def _attention(
        self,
        index: int,
        layer: _Layer,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        fill_table: torch.Tensor,
        read_table: torch.Tensor | None,
        mask: torch.Tensor | None,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        spec = self.spec
        batch, seq, _ = x.shape
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        q, k, v = F.linear(x, layer.qkv).split((q_width, kv_width, kv_width), dim=-1)
        q = q.reshape(batch, seq, spec.num_heads, spec.head_dim).transpose(1, 2)  # [B, H, S, D]
        k = k.reshape(batch, seq, spec.num_kv_heads, spec.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = v.reshape(batch, seq, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        # Write before reading so a chunk attends to its own keys through the pool.
        kv.fill(index, k, v, fill_table)
        if read_table is None:
            out = self._sdpa(q, k, v, is_causal=True)
        else:
            k_all, v_all = kv.gather(index, read_table)  # [B, Hkv, Wr*bs, D]
            out = self._sdpa(q, k_all.to(q.dtype), v_all.to(q.dtype), attn_mask=mask)
        return out.transpose(1, 2).reshape(batch * seq, spec.num_heads * spec.head_dim)  # before o_proj

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        """Grouped-query SDPA. On the CPU the flash kernel reads the shared K/V
        heads itself (``enable_gqa``, causal and masked alike; measured 4-20%
        faster than expanding them at 144-2048 tokens, and what transformers
        does). On CUDA only the flash kernel takes ``enable_gqa`` (half
        precision, no mask); fp32 or masked calls would drop to the math
        kernel, so K/V are expanded there."""
        groups = self.spec.num_heads // self.spec.num_kv_heads
        if self.device.type == "cpu":
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1, **kwargs)
        return F.scaled_dot_product_attention(q, _expand_kv(k, groups), _expand_kv(v, groups), **kwargs)

    @staticmethod
    def _mlp_hidden(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T) as ``[B*S, I]``, in place on the gate output (the
        down projection is fused with the residual add by the caller)."""
        x = x.view(-1, x.shape[-1])
        hidden = F.silu(F.linear(x, layer.gate), inplace=True)
        return hidden.mul_(F.linear(x, layer.up))

    @torch.inference_mode()
    def lm_head(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]``."""
        rows = hidden_rows.to(self.dtype)
        if self.device.type != "cpu":
            return F.linear(rows, self._head).float()
        # On the CPU the head GEMM runs vocab-major, W @ rows^T: for the few
        # rows a prefill keeps, MKL streams the [vocab, hidden] weight in this
        # orientation 1.5-3.4x faster than F.linear's rows @ W^T (measured
        # 1-32 rows, 32000 x 512). One row is sent as two because the
        # single-column case falls to a matrix-vector kernel about as slow as
        # F.linear.
        n = rows.shape[0]
        columns = torch.cat((rows, rows)).t() if n == 1 else rows.t()
        return torch.mm(self._head, columns)[:, :n].t().float().contiguous()
