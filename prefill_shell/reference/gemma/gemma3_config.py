"""Gemma 3's text decoder description, read from HF ``config.json`` as transformers reads it.

Two config shapes carry it: ``model_type: gemma3_text`` (``Gemma3ForCausalLM``,
the 1B checkpoint) and ``model_type: gemma3`` (``Gemma3ForConditionalGeneration``,
4B and up), whose text decoder is the nested ``text_config``; the vision
tower's keys are not read (this is a text model). What differs from the
Llama-shaped families: RoPE per layer type (the full layers' base and
scaling, the sliding layers' own base: transformers 5 keys both under
``rope_parameters`` by layer type; legacy configs spell them ``rope_theta`` +
``rope_scaling`` and ``rope_local_base_freq``), attention scaled by
``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``, the window
on the layers ``layer_types`` marks (legacy: every ``sliding_window_pattern``-th
layer is full), and an optional tanh cap on the final logits (refused in a
nested config: transformers' multimodal model ignores it, vLLM applies it).

As in ``config.py`` every text-config key is computed, inert or refused
unless it holds the value the reference computes: a setting that would load
and give other logits is a ``PrefillConfigError`` naming the key.
"""

from __future__ import annotations

from typing import Any

import attrs

from prefill_core.values.dtype import DTYPES
from prefill_core.values.errors import PrefillConfigError
from prefill_shell.device.model import ModelSpec
from prefill_shell.reference.llama_like.config import COMPUTED_KEYS, INERT_KEYS, _int, _number, _positive
from prefill_shell.reference.llama_like.config import GEMMA3_ARCHITECTURES as ARCHITECTURES
from prefill_shell.reference.llama_like.rope import RopeScaling, read_rope

__all__ = ["GEMMA3_COMPUTED_KEYS", "GEMMA3_INERT_KEYS", "GEMMA3_REFUSED_KEYS", "Gemma3Spec", "text_config_of"]

_SLIDING, _FULL = "sliding_attention", "full_attention"

GEMMA3_COMPUTED_KEYS = (COMPUTED_KEYS - {"attention_bias", "use_sliding_window", "max_window_layers"}) | {
    "query_pre_attn_scalar",
    "sliding_window_pattern",  # legacy: layer i is full when (i + 1) % pattern == 0
    "rope_local_base_freq",
    "final_logit_softcapping",
}
"""Text-config keys the reference Gemma 3 reads and computes."""

GEMMA3_INERT_KEYS = (INERT_KEYS - {"pretraining_tp"}) | {
    "_sliding_window_pattern",  # written back by transformers 5 and not read on load (layer_types is)
    "hidden_act",  # Gemma 2's spelling: Gemma 3's model reads hidden_activation only
}
"""Text-config keys that do not change an inference forward pass."""

GEMMA3_REFUSED_KEYS: dict[str, object] = {
    "hidden_activation": "gelu_pytorch_tanh",
    "attention_bias": False,
    "attn_logit_softcapping": None,  # Gemma 2's score cap; Gemma 3 checkpoints carry none
    "use_bidirectional_attention": False,  # the embedding variants' non-causal attention
    "partial_rotary_factor": 1.0,
    "quantization_config": None,
}
"""Text-config keys refused unless absent or this value."""


def text_config_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config: ``cfg`` itself (``gemma3_text``) or its ``text_config`` (``gemma3``).

    A nested config inherits the outer dtype where the text config is
    silent (transformers writes it at the top level). The tie flag is read
    by level as transformers' classes read it: ``Gemma3ForConditionalGeneration``
    ties its head by the top-level ``tie_word_embeddings`` (default true) and
    never reads the text config's, so a nested config's own flag is replaced
    by the top-level one.
    """
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise PrefillConfigError(f"config.json model_type={model_type!r} is not Gemma 3 (gemma3_text or gemma3)")
    for name in cfg.get("architectures") or ():
        if name != ARCHITECTURES[model_type]:
            loads = ARCHITECTURES[model_type]
            msg = f"config.json architectures entry {name!r} is unsupported: {model_type!r} loads {loads!r}"
            raise PrefillConfigError(msg)
    if model_type == "gemma3_text":
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise PrefillConfigError(f"config.json text_config={text!r} is invalid: a gemma3 config nests its text model")
    if text.get("final_logit_softcapping") is not None:
        # transformers' Gemma3ForConditionalGeneration never applies it, vLLM's Gemma 3 does: no answer is right
        cap = text["final_logit_softcapping"]
        msg = (
            f"config.json text_config.final_logit_softcapping={cap!r} is unsupported: transformers' "
            "Gemma3ForConditionalGeneration ignores it and vLLM applies it (published Gemma 3 checkpoints hold null)"
        )
        raise PrefillConfigError(msg)
    inherited = {k: cfg[k] for k in ("dtype", "torch_dtype") if k in cfg and k not in text}
    tie = cfg.get("tie_word_embeddings", True)  # Gemma3Config's default; the text config's flag is not read
    return {**inherited, **text, "tie_word_embeddings": tie, "model_type": "gemma3_text", "architectures": None}


def _refuse_uncomputed(cfg: dict[str, Any]) -> None:
    for key, wanted in GEMMA3_REFUSED_KEYS.items():
        value = cfg.get(key)
        if value is None or value == wanted or (wanted is None and not value):
            continue
        raise PrefillConfigError(
            f"config.json {key}={value!r} is unsupported: the reference Gemma 3 computes {wanted!r}"
        )


def _layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:
        pattern = _int(cfg, "sliding_window_pattern", 6)
        return tuple(_FULL if (i + 1) % pattern == 0 else _SLIDING for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or any(t not in (_SLIDING, _FULL) for t in types):
        msg = f"config.json layer_types={types!r} is invalid: one of {(_SLIDING, _FULL)} per layer"
        raise PrefillConfigError(msg)
    return tuple(types)


def _sliding_window(cfg: dict[str, Any], types: tuple[str, ...], max_position: int) -> int:
    """The window of the sliding layers: 4096 where the key is absent (``Gemma3TextConfig``'s default).

    A ``null`` window is what transformers refuses once a layer slides (its
    model raises "Could not find a `sliding_window` argument" on the first
    forward): refused by name here, never replaced by the default. With no
    sliding layer it is never read (the maximum position stands in).
    """
    if "sliding_window" in cfg and cfg["sliding_window"] is None:
        sliding = [i for i, kind in enumerate(types) if kind == _SLIDING]
        if not sliding:
            return max_position
        raise PrefillConfigError(
            f"config.json sliding_window=None is invalid: layer_types marks layers {sliding} sliding_attention, "
            "which need a window (transformers' Gemma 3 refuses this config on its first forward); give "
            "sliding_window an integer or mark those layers full_attention"
        )
    return _int(cfg, "sliding_window", 4096)


def _rope_by_type(cfg: dict[str, Any], max_position: int) -> dict[str, tuple[float, RopeScaling | None]]:
    """``{layer type: (theta, scaling)}`` as transformers' ``convert_rope_params_to_dict`` resolves them.

    A theta inside ``rope_parameters[type]`` wins; else the legacy keys
    (``rope_theta`` for full layers, ``rope_local_base_freq`` for sliding
    ones); else 1e6 and 1e4. A legacy ``rope_scaling`` scales full layers only.
    """
    params = cfg.get("rope_parameters")
    params = {} if params is None else params
    if not isinstance(params, dict) or any(k not in (_SLIDING, _FULL) for k in params):
        msg = f"config.json rope_parameters={params!r} is invalid: Gemma 3 keys it by layer type {(_SLIDING, _FULL)}"
        raise PrefillConfigError(msg)
    legacy = {_FULL: ("rope_theta", 1_000_000.0), _SLIDING: ("rope_local_base_freq", 10_000.0)}
    out = {}
    for kind, (key, default) in legacy.items():
        table = dict(params.get(kind) or {"rope_type": "default"})
        if kind == _FULL and cfg.get("rope_scaling"):
            table.update(cfg["rope_scaling"])
        if table.get("rope_theta") is None:
            table["rope_theta"] = cfg[key] if cfg.get(key) is not None else default
        extra = {k: cfg[k] for k in ("original_max_position_embeddings", "partial_rotary_factor") if k in cfg}
        out[kind] = read_rope({**extra, "rope_parameters": table}, max_position)
    return out


@attrs.frozen
class Gemma3Spec:
    """Everything about a Gemma 3 text checkpoint the reference model needs."""

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rms_norm_eps: float = attrs.field(converter=float, validator=_positive)
    query_pre_attn_scalar: float = attrs.field(converter=float, validator=_positive)
    sliding_window: int = attrs.field(validator=_positive)
    layer_types: tuple[str, ...]
    rope: tuple[tuple[str, float, RopeScaling | None], ...]  # (layer type, theta, scaling), full then sliding
    max_position_embeddings: int = attrs.field(validator=_positive)
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    dtype: str = "float32"

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            msg = f"num_kv_heads={self.num_kv_heads!r} is invalid: must divide num_heads={self.num_heads!r}"
            raise PrefillConfigError(msg)
        if self.head_dim % 2:
            raise PrefillConfigError(f"head_dim={self.head_dim!r} is invalid: RoPE needs an even head_dim")
        if len(self.layer_types) != self.num_layers:
            raise PrefillConfigError(f"layer_types={self.layer_types!r} is invalid: needs one entry per layer")
        if self.dtype not in DTYPES:
            raise PrefillConfigError(f"dtype={self.dtype!r} is invalid: expected one of {DTYPES}")

    def model_spec(self) -> ModelSpec:
        """The architecture-neutral part the runtime sees."""
        return ModelSpec(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position=self.max_position_embeddings,
        )

    def rope_of(self, layer_type: str) -> tuple[float, RopeScaling | None]:
        """``(theta, scaling)`` of the layers of ``layer_type``."""
        return next((theta, scaling) for kind, theta, scaling in self.rope if kind == layer_type)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> Gemma3Spec:
        """Reads a parsed ``config.json`` (``gemma3_text``, or ``gemma3`` with its ``text_config``)."""
        if not isinstance(cfg, dict):
            raise PrefillConfigError(f"config.json holds a {type(cfg).__name__}, expected a JSON object")
        text = text_config_of(cfg)
        _refuse_uncomputed(text)
        layers = _int(text, "num_hidden_layers", 26)
        max_position = _int(text, "max_position_embeddings", 131_072)
        cap = text.get("final_logit_softcapping")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise PrefillConfigError(f"config.json final_logit_softcapping={cap!r} is invalid: a positive number")
        rope = _rope_by_type(text, max_position)
        types = _layer_types(text, layers)
        return cls(
            vocab_size=_int(text, "vocab_size", 262_208),
            hidden_size=_int(text, "hidden_size", 2304),
            intermediate_size=_int(text, "intermediate_size", 9216),
            num_layers=layers,
            num_heads=_int(text, "num_attention_heads", 8),
            num_kv_heads=_int(text, "num_key_value_heads", 4),
            head_dim=_int(text, "head_dim", 256),
            rms_norm_eps=_number(text, "rms_norm_eps", 1e-6),
            query_pre_attn_scalar=_number(text, "query_pre_attn_scalar", 256),
            sliding_window=_sliding_window(text, types, max_position),
            layer_types=types,
            rope=tuple((kind, *rope[kind]) for kind in (_FULL, _SLIDING)),
            max_position_embeddings=max_position,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
            final_logit_softcapping=None if cap is None else float(cap),
            dtype=str(text.get("dtype") or text.get("torch_dtype") or "float32"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` ``Gemma3ForCausalLM.from_pretrained`` accepts (transformers 5 spelling)."""
        rope = {}
        for kind, theta, scaling in self.rope:
            rope[kind] = {"rope_type": "default", **({} if scaling is None else scaling.to_hf_dict())}
            rope[kind]["rope_theta"] = theta
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "final_logit_softcapping": self.final_logit_softcapping,
            "hidden_activation": "gelu_pytorch_tanh",
            "dtype": self.dtype,
        }
