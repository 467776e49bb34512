"""A torch Llama-shaped decoder whose attention reads and writes a paged KV pool.

It implements ``PrefillModel`` and mirrors Hugging Face's numerics for the
Llama, Mistral, Qwen2 and Qwen3 families (RMSNorm in float32, half-split
RoPE with the scalings ``reference/llama_like/rope.py`` computes, grouped query
attention, SwiGLU), so that it can be checked against ``transformers`` on the
same weights. What differs by family is read from ``LlamaSpec``: each layer
takes its attention options (Q/K/V and output biases, per-head Q/K RMSNorm)
from ``LlamaSpec.layer_attention``. Weights are plain tensors keyed by their
HF names.

``forward_hidden`` has a capture-safe form: shapes come only from input
shapes, ``start`` stays on the device, and ``-1`` page-table entries are
handled by the pool's sink block rather than by masking or branching. It is
taken under CUDA graph capture and ``torch.compile`` (or on request); eagerly,
a chunked step reads ``start`` on the host and gathers only the cached prefix.

What a chunked step reads: positions before ``start`` through the read table
(the cached prefix and earlier chunks), and the chunk's own K/V as computed,
never the pool's copy of ``[start, start + S)``. Every other pool value (filler
columns, the row's later blocks, the sink, stale blocks) is either not gathered
or replaced by zero before it meets a query, so NaN, inf or stale garbage there
cannot reach an output or a written block: a boolean mask alone would not do,
since a masked NaN score or ``0 * NaN`` in the value product is still NaN.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from prefill_core import ceil_div
from prefill_core.values.errors import PrefillConfigError
from prefill_shell.reference.cpu_kernels.flash import flash_step
from prefill_shell.reference.cpu_kernels.rms_norm import rms_norm_rows
from prefill_shell.reference.cpu_kernels.rope import rope_step
from prefill_shell.reference.llama_like.config import LayerAttention, LlamaSpec
from prefill_shell.reference.llama_like.packed_attention import (
    end_segments,
    packed_writes,
    segment_attention,
    segment_reads,
    shared_packed_writes,
    write_packed,
)
from prefill_shell.reference.llama_like.projection import Projection, prepacks
from prefill_shell.reference.llama_like.rope import rope_inv_freq as scaled_inv_freq
from prefill_shell.reference.pools.kv_cache import PagedKVCache

__all__ = ["PagedLlama", "llama_weight_shapes", "rope_inv_freq"]


class _Layer(NamedTuple):
    attention: LayerAttention
    attn_norm: torch.Tensor
    qkv: Projection  # [q_out + 2 * kv_out, hidden]: one matmul for Q, K and V (and their biases)
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: q_norm per query head, then k_norm per KV head
    o: Projection
    mlp_norm: torch.Tensor
    gate: Projection
    up: Projection
    down: Projection
    gate_up: Projection | None  # [2 * inter, hidden] where the weights are not prepacked (see _layer)


class _ChunkReads(NamedTuple):
    """What every layer of one chunked step reads from the pool, decided once per step."""

    columns: int  # read-table columns gathered: the prefix before the chunk (static under capture)
    readable: torch.Tensor | None  # [B, 1, columns*bs, 1] bool: position < start; None when all are
    mask: torch.Tensor | None  # [B, 1, S, columns*bs + S] bool; None: causal over the chunk alone


def _capturing(start: torch.Tensor) -> bool:
    """True where shapes must not depend on values: CUDA graph capture or torch.compile tracing."""
    if torch.compiler.is_compiling():
        return True
    return start.is_cuda and torch.cuda.is_current_stream_capturing()


def _chunk_reads(start: torch.Tensor, seq: int, read_table: torch.Tensor, bs: int, fixed_shape: bool) -> _ChunkReads:
    """Sizes a chunked step's pool read and builds its mask.

    Keys are laid out as ``[prefix | chunk]``: ``columns*bs`` positions read
    through the table, then the chunk's own ``S`` fresh keys. A query at
    ``start + i`` sees prefix positions ``< start`` and chunk keys ``<= i``,
    so no query row is ever fully masked (each sees at least its own key).
    """
    batch, width = read_table.shape
    if fixed_shape:
        # Shapes from shapes only: the widest prefix a chunk that the table
        # covers can have (start + S <= Wr*bs); rows starting earlier mask
        # and zero the rest of it.
        columns, all_readable = max(width - seq // bs, 0), False
    else:
        # Eager: one host read of start sizes the gather to the cached prefix.
        starts = start.tolist()
        if max(starts) > width * bs:
            raise ValueError(f"chunk start {max(starts)} lies past the read table's {width * bs} positions")
        columns = max(ceil_div(max(starts), bs), 0)
        all_readable = all(s == columns * bs for s in starts)
    if columns == 0:
        return _ChunkReads(0, None, None)
    device = start.device
    before = torch.arange(columns * bs, device=device)[None, :] < start.to(torch.int64)[:, None]  # [B, P]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    mask = torch.cat((before[:, None, None, :].expand(batch, 1, seq, -1), causal.expand(batch, 1, seq, seq)), dim=-1)
    return _ChunkReads(columns, None if all_readable else before[:, None, :, None], mask)


def _with_prefix(
    kv: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, read_table: torch.Tensor, reads: _ChunkReads
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's fresh ``k, v [B, Hkv, S, D]`` behind the prefix gathered from the pool."""
    old_k, old_v = kv.gather(layer, read_table[:, : reads.columns])  # [B, Hkv, columns*bs, D]
    if reads.readable is not None:
        # Select, not multiply: a masked NaN or inf times zero is still NaN,
        # and the mask alone leaves NaN scores (NaN + -inf) and 0 * NaN values.
        old_k = torch.where(reads.readable, old_k, 0.0)
        old_v = torch.where(reads.readable, old_v, 0.0)
    return torch.cat((old_k.to(k.dtype), k), dim=2), torch.cat((old_v.to(v.dtype), v), dim=2)


def llama_weight_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must provide, by HF name, with its shape.

    ``lm_head.weight`` is absent when the embeddings are tied; biases and
    Q/K norms are present where the layer's ``LayerAttention`` says so.
    """
    h, inter = spec.hidden_size, spec.intermediate_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attention = spec.layer_attention(i)
        shapes[p + "input_layernorm.weight"] = (h,)
        for name, rows in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, h)
            if attention.qkv_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        if attention.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (spec.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (spec.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if attention.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def rope_inv_freq(spec: LlamaSpec) -> torch.Tensor:
    """Per-pair rotation frequencies ``[head_dim // 2]`` (float32), scaled as the spec's RoPE says.

    Computed in float32 like HF does, so both sides round the same way.
    """
    return scaled_inv_freq(spec.rope_theta, spec.head_dim, spec.rope_scaling)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; ``weight`` is ``[D]`` or broadcasts over ``x`` (one per head)."""
    if weight.dim() == 1 and x.device.type == "cpu":
        fused = rms_norm_rows(x, weight, eps)  # one pass, HF's roundings (reference/cpu_kernels); None: not here
        if fused is not None:
            return fused
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # torch's own: fewer passes than the expression below
    # At half precision HF's bits: normalise in float32, round to the model dtype, then scale
    # (F.rms_norm would scale before rounding). In place where HF allocates: same ops, two fewer passes.
    x32 = x.float()
    x32.mul_(x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_())
    return x32.to(x.dtype).mul_(weight)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [..., S, heads, D]; cos/signed_sin: [..., S, 1, D]. Half-split pairs (i, i + D/2), HF's layout:
    # x*cos + cat(-x2, x1)*sin, with the minus folded into the first half of the sin table.
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(swapped.mul_(signed_sin), x, cos)


def _split_qkv(
    qkv: torch.Tensor, spec: LlamaSpec, layer: _Layer, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[..., S, q_out + 2 * kv_out]`` -> rotated ``q [..., S, H, D]``, ``k, v [..., S, Hkv, D]`` (views).

    Q and K lie side by side in the fused projection's output, so one rotary
    pass (and one per-head RMSNorm before it, where the layer has Q/K norms)
    covers both heads' groups.
    """
    qk, v = _normed_qk_and_v(qkv, spec, layer)
    qk = _apply_rope(qk, cos, signed_sin)
    return qk[..., : spec.num_heads, :], qk[..., spec.num_heads :, :], v


def _normed_qk_and_v(qkv: torch.Tensor, spec: LlamaSpec, layer: _Layer) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., q_out + 2 * kv_out]`` -> ``qk [..., H + Hkv, D]`` (per-head RMSNorm applied where the layer has
    Q/K norms) and ``v [..., Hkv, D]`` (a view), before rotary."""
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qk = qkv[..., : (heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim))
    if layer.qk_norm is not None:
        qk = _rms_norm(qk, layer.qk_norm, spec.rms_norm_eps)
    return qk, qkv[..., (heads + kv_heads) * dim :].unflatten(-1, (kv_heads, dim))


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, H_kv, T, D] -> [B, H_kv * groups, T, D]; query head h uses kv head h // groups.
    # expand + reshape rather than repeat_interleave: pure shape arithmetic, no
    # chance of a host sync while a CUDA graph is being captured.
    if groups == 1:
        return x
    batch, heads, seq, dim = x.shape
    return x[:, :, None].expand(batch, heads, groups, seq, dim).reshape(batch, heads * groups, seq, dim)


class PagedLlama:
    """A Llama-shaped decoder (Llama, Mistral, Qwen2, Qwen3) with paged KV.

    Implements ``prefill_shell.device.model.PrefillModel``, packed steps included.
    """

    packed_steps = True  # forward_packed: segments end to end (reference/llama_like/packed_attention.py)
    segment_ends = True  # forward_packed(..., ends_only=True): the last layer past attention for segment ends only
    shared_writes = True  # forward_packed(..., shared_writes=pairs): a step's K/V written into more slots too
    chunked_waves = True  # a chunked step's rows each read and write through their own table rows

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
        self._head = Projection(w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"])
        freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), rope_inv_freq(config))
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        # Precomputed tables turn position handling into a gather with static shapes;
        # YaRN's attention factor scales cos and sin in float32, as HF does.
        factor = config.rope_attention_factor
        self._cos = (angles.cos() * factor).to(self.device)
        half = angles.shape[-1] // 2
        sin = angles.sin() * factor
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
        attention = self.config.layer_attention(i)
        # Q/K/V share one input and fuse into one matmul. Gate/up fuse too
        # where the weights are plain (fp16, bf16 without matrix instructions,
        # CUDA): one [2*I, H] matmul and SwiGLU in two passes; prepacked weights
        # (fp32, native bf16) keep them two oneDNN calls with SwiGLU inside,
        # which is faster there than the fused matmul.
        qkv = self._fuse([p + f"self_attn.{n}_proj.weight" for n in "qkv"])
        qkv_bias = self._fuse([p + f"self_attn.{n}_proj.bias" for n in "qkv"]) if attention.qkv_bias else None
        qk_norm = None
        if attention.qk_norm:
            heads, kv_heads = self.config.num_heads, self.config.num_kv_heads
            q_norm, k_norm = w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"]
            qk_norm = torch.cat((q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)))
        mlp = [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")]
        gate_up = None if prepacks(w[mlp[0]]) else Projection(self._fuse(mlp))
        return _Layer(
            attention=attention,
            attn_norm=w[p + "input_layernorm.weight"],
            qkv=Projection(qkv, qkv_bias),
            qk_norm=qk_norm,
            o=Projection(w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias")),
            mlp_norm=w[p + "post_attention_layernorm.weight"],
            gate=Projection(w[p + "mlp.gate_proj.weight"]),
            up=Projection(w[p + "mlp.up_proj.weight"]),
            down=Projection(w[p + "mlp.down_proj.weight"]),
            gate_up=gate_up,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights by HF name (shared tensors, not copies)."""
        return dict(self.weights)

    def new_kv_cache(
        self, num_blocks: int, block_size: int, *, device: torch.device | str | None = None
    ) -> PagedKVCache:
        """A zeroed pool of ``num_blocks`` blocks of ``block_size`` tokens sized for this model (``device`` by
        keyword: every model's ``new_kv_cache`` takes ``(num_blocks, block_size)`` the same way)."""
        spec = self.spec
        return PagedKVCache(
            spec.num_layers,
            num_blocks,
            block_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=self.dtype,
            device=self.device if device is None else device,
        )

    @torch.inference_mode()
    def forward_hidden(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        fill_table: torch.Tensor,
        read_table: torch.Tensor | None,
        kv: PagedKVCache,
        *,
        fixed_shape: bool | None = None,
    ) -> torch.Tensor:
        """One model-body step over a padded wave; see ``PrefillModel.forward_hidden``.

        ``fixed_shape`` picks how a chunked step reads the pool: True is the
        capture-safe form (gather width from the table's width, ``start``
        never leaves the device), False the eager one (gathers only the
        prefix before ``start``). By default the capture-safe form is taken
        under CUDA graph capture or ``torch.compile``. Both require the read
        table to cover the chunk, ``start + S <= Wr*bs``, and ``start`` to be
        a multiple of the block size.
        """
        seq = tokens.shape[1]
        if seq % kv.block_size:
            raise ValueError(f"invocation length {seq} is not a multiple of block size {kv.block_size}")
        positions = start.to(torch.int64)[:, None] + torch.arange(seq, device=tokens.device)  # [B, S]
        # Padded tails may run past the table; clamping keeps the gather in bounds
        # without a host check, and those positions never feed a real query.
        table_pos = positions.clamp(max=self.config.max_position_embeddings - 1)
        cos = self._cos[table_pos].to(self.dtype).unsqueeze(2)  # [B, S, 1, D]
        sin = self._signed_sin[table_pos].to(self.dtype).unsqueeze(2)
        reads = None
        if read_table is not None:
            fixed = _capturing(start) if fixed_shape is None else fixed_shape
            reads = _chunk_reads(start, seq, read_table, kv.block_size, fixed)
        batch = tokens.shape[0]
        residual = F.embedding(tokens, self._embed).view(batch * seq, -1)  # [B*S, H]
        eps = self.config.rms_norm_eps
        for i, layer in enumerate(self._layers):
            normed = _rms_norm(residual, layer.attn_norm, eps).view(batch, seq, -1)
            attn = self._attention(i, layer, normed, (cos, sin), fill_table, read_table, reads, kv)
            residual = layer.o.plus(attn, residual)
            residual = self._mlp(layer, _rms_norm(residual, layer.mlp_norm, eps), residual)
        return _rms_norm(residual, self._final_norm, eps).view(batch, seq, -1)

    @torch.inference_mode()
    def forward_packed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        segments: torch.Tensor,
        prefix_table: torch.Tensor,
        kv: PagedKVCache,
        *,
        ends_only: bool = False,
        shared_writes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One packed step; see ``PrefillModel.forward_packed``. Returns ``[1, T, hidden]``.

        ``shared_writes`` (``device.model.SHARED_WRITES_CAPABILITY``): ``[N, 2]`` (token, slot) pairs; each
        layer writes those tokens' K/V into those slots too, right after the step's own writes.

        ``ends_only`` (``device.model.SEGMENT_ENDS_CAPABILITY``): only each segment's last token's row is
        computed, the others are zero. Every layer still writes every token's K/V; the last layer runs its
        attention (on the CPU kernel; elsewhere every query's, then the ends taken), ``o_proj``, MLP and final
        norm for the segments' last tokens alone, the only rows a step's sampling reads.
        """
        total = tokens.shape[0]
        cos = self._cos[positions].to(self.dtype)  # [T, D]
        sin = self._signed_sin[positions].to(self.dtype)
        # On the CPU, one kernel call per layer covers every segment's attention, and one its rotary and pool
        # writes (reference/cpu_kernels); None: torch's ops, as on CUDA or where a kernel lacks the dtype or size.
        flash = rope = None
        if self.device.type == "cpu":
            spec = self.spec
            flash = flash_step(
                segments, prefix_table, kv, spec.num_heads, spec.num_kv_heads, spec.head_dim, self.dtype, total
            )
            rope = rope_step(cos, sin, write_slots, kv, spec.num_heads, spec.num_kv_heads)
        reads = segment_reads(segments, prefix_table, kv.block_size, self.dtype) if flash is None else None
        writes = packed_writes(write_slots, kv.block_size) if rope is None else None
        shared = None if shared_writes is None else shared_packed_writes(shared_writes, kv.block_size)
        ends = (segments[:, 0] + segments[:, 1] - 1).to(torch.int64) if ends_only else None  # each segment's last
        last_flash = None  # the last layer's attention for the ends alone, reading the step's own K/V from the pool
        if ends is not None and flash is not None and bool((write_slots[ends] >= 0).all()):
            end_table = end_segments(segments, prefix_table, write_slots, kv.block_size)
            spec = self.spec
            last_flash = flash_step(
                *end_table, kv, spec.num_heads, spec.num_kv_heads, spec.head_dim, self.dtype, len(ends)
            )
        residual = F.embedding(tokens, self._embed)  # [T, H]
        eps = self.config.rms_norm_eps
        for i, layer in enumerate(self._layers):
            qkv = layer.qkv(_rms_norm(residual, layer.attn_norm, eps))
            if rope is not None:
                q, k, v = rope(kv, i, *_normed_qk_and_v(qkv, self.config, layer))  # K/V written to the pool too
            else:
                q, k, v = _split_qkv(qkv, self.config, layer, cos[:, None], sin[:, None])  # token-major [T, heads, D]
                write_packed(kv, i, k, v, writes)
            if shared is not None:  # before this layer's attention reads the pool
                write_packed(kv, i, k, v, shared)
            if ends is not None and i == len(self._layers) - 1:  # no later layer reads the other rows
                if last_flash is not None:
                    attn = last_flash(kv, i, q[ends], k[ends], v[ends])  # the K/V above are in the pool by now
                else:
                    attn = self._packed_attention(kv, i, (q, k, v), flash, reads)[ends]
                residual = residual[ends]
            else:
                attn = self._packed_attention(kv, i, (q, k, v), flash, reads)
            residual = layer.o.plus(attn.flatten(1), residual)
            residual = self._mlp(layer, _rms_norm(residual, layer.mlp_norm, eps), residual)
        hidden = _rms_norm(residual, self._final_norm, eps)
        if ends is not None:
            rows, hidden = hidden, hidden.new_zeros(total, hidden.shape[-1])
            hidden[ends] = rows
        return hidden.view(1, total, -1)

    def _packed_attention(self, kv: PagedKVCache, layer: int, qkv: tuple, flash, reads) -> torch.Tensor:
        """A packed step's attention of one layer, ``[T, H, D]``: the CPU kernel's step, or torch's per segment."""
        if flash is not None:
            return flash(kv, layer, *qkv)
        return segment_attention(kv, layer, qkv, reads, self._sdpa)

    def _attention(
        self,
        index: int,
        layer: _Layer,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        fill_table: torch.Tensor,
        read_table: torch.Tensor | None,
        reads: _ChunkReads | None,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        spec = self.spec
        batch, seq, _ = x.shape
        rotated = _split_qkv(layer.qkv(x), self.config, layer, *rope)
        q, k, v = (t.transpose(1, 2) for t in rotated)  # [B, heads, S, D]
        kv.fill(index, k, v, fill_table)
        if reads is None or reads.mask is None:  # regular prefill, or a chunk with no prefix
            out = self._sdpa(q, k, v, is_causal=True)
        else:
            k_all, v_all = _with_prefix(kv, index, k, v, read_table, reads)  # [B, Hkv, P + S, D]
            out = self._sdpa(q, k_all, v_all, attn_mask=reads.mask)
        return out.transpose(1, 2).reshape(batch * seq, spec.num_heads * spec.head_dim)  # before o_proj

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        """Grouped-query SDPA. On the CPU the flash kernel reads the shared K/V
        heads itself (``enable_gqa``, causal and masked alike; cheaper than
        expanding them, and what transformers does). On CUDA only the flash kernel takes ``enable_gqa`` (half
        precision, no mask); fp32 or masked calls would drop to the math
        kernel, so K/V are expanded there."""
        groups = self.spec.num_heads // self.spec.num_kv_heads
        if self.device.type == "cpu":
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1, **kwargs)
        return F.scaled_dot_product_attention(q, _expand_kv(k, groups), _expand_kv(v, groups), **kwargs)

    @staticmethod
    def _mlp(layer: _Layer, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + (silu(x W_gate^T) * (x W_up^T)) W_down^T`` as ``[B*S, H]``."""
        x = x.view(-1, x.shape[-1])
        if layer.gate_up is None:
            return layer.down.plus(layer.up.times(x, layer.gate.silu(x)), residual)
        gate_up = layer.gate_up(x)  # [T, 2 * inter]: gate | up
        gate, up = gate_up.chunk(2, dim=-1)
        return layer.down.plus(F.silu(gate, inplace=True).mul(up), residual)

    @torch.inference_mode()
    def lm_head(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]``."""
        return self._head(hidden_rows.to(self.dtype)).float()
