"""The decoder architecture description, read from and written to HF ``config.json``.

One description covers the Llama-shaped families people run: ``llama``,
``mistral``, ``qwen2`` and ``qwen3``. They differ only in per-layer attention
options (``LayerAttention``: Q/K/V and output biases, per-head Q/K RMSNorm),
in defaults for absent keys, and in how a sliding window is switched on.
Every key of these families' configs is in exactly one table below:
computed, without effect on an inference forward pass, or refused unless it
holds the value the reference model computes. A setting that would load and
give different logits is a ``PrefillConfigError`` naming the key: the
strict loader stays strict. RoPE settings are read in ``reference/llama_like/rope.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from prefill_core.values.dtype import DTYPES
from prefill_core.values.errors import PrefillConfigError
from prefill_shell.device.model import ModelSpec
from prefill_shell.reference.llama_like.rope import (
    LinearRopeScaling,
    Llama3RopeScaling,
    RopeScaling,
    YarnRopeScaling,
    read_rope,
)

__all__ = [
    "COMPUTED_KEYS",
    "FAMILIES",
    "INERT_KEYS",
    "REFUSED_KEYS",
    "LayerAttention",
    "Llama3RopeScaling",
    "LinearRopeScaling",
    "LlamaSpec",
    "YarnRopeScaling",
    "check_computed",
    "in_folder",
    "needs_hybrid",
    "read_config_dict",
    "read_config_json",
    "sliding_layers",
]


def _positive(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value <= 0:
        raise PrefillConfigError(f"{attribute.name}={value!r} is invalid: must be positive")


@attrs.frozen
class LayerAttention:
    """What one decoder layer's attention computes beyond plain causal grouped-query attention.

    The one place per-layer attention options live: the model builds each
    layer from ``LlamaSpec.layer_attention(i)``, so an option that differs
    by layer (a sliding window) is added here and nowhere else.
    """

    qkv_bias: bool = False  # q_proj, k_proj and v_proj carry biases (Qwen2; Llama/Qwen3 attention_bias)
    o_bias: bool = False  # o_proj carries a bias (Llama/Qwen3 attention_bias)
    qk_norm: bool = False  # RMSNorm over each head's Q and K before RoPE (Qwen3)


@attrs.frozen
class _Family:
    """How one ``model_type`` spells its options and what it assumes for absent keys."""

    architecture: str
    default_head_dim: int | None  # None: hidden_size // num_attention_heads
    default_max_position: int
    window_switch: str | None  # "always": sliding_window alone turns it on; "flag": only with use_sliding_window
    default_window: int | None


def _layer_attention(model_type: str, cfg: dict[str, Any]) -> LayerAttention:
    """Each family's attention options as its transformers model builds them from the config."""
    bias = cfg.get("attention_bias") is True  # Llama and Qwen3: on all four projections
    if model_type == "qwen2":
        return LayerAttention(qkv_bias=True)  # always, and never on o_proj
    if model_type == "qwen3":
        return LayerAttention(qkv_bias=bias, o_bias=bias, qk_norm=True)
    if model_type == "mistral":
        return LayerAttention()  # no bias option at all
    return LayerAttention(qkv_bias=bias, o_bias=bias)


FAMILIES: dict[str, _Family] = {
    # transformers' own config-class defaults for keys a config.json leaves out
    "llama": _Family("LlamaForCausalLM", None, 2048, None, None),
    "mistral": _Family("MistralForCausalLM", None, 4096 * 32, "always", 4096),
    "qwen2": _Family("Qwen2ForCausalLM", None, 32768, "flag", 4096),
    "qwen3": _Family("Qwen3ForCausalLM", 128, 32768, "flag", 4096),
}

COMPUTED_KEYS = frozenset(
    {
        "model_type",
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "dtype",
        "torch_dtype",
        # read to decide that no layer slides; an effective window is refused
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    }
)
"""Keys the reference model reads and computes (a window only as 'none')."""

INERT_KEYS = frozenset(
    {
        "transformers_version",
        "output_hidden_states",
        "return_dict",
        "chunk_size_feed_forward",  # the same MLP, computed in pieces
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "initializer_range",  # initialisation of new weights only
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "attention_dropout",  # dropout is off at inference
        "pretraining_tp",  # a split of the same matmuls (transformers 4); the sum is unchanged
    }
)
"""Keys of these families' configs that do not change an inference forward pass."""

REFUSED_KEYS: dict[str, object] = {
    "hidden_act": "silu",
    "mlp_bias": False,
    "partial_rotary_factor": 1.0,
    "quantization_config": None,
}
"""Keys refused unless they hold this value (RoPE types and sliding windows are refused in their readers)."""


def _refuse_uncomputed(cfg: dict[str, Any]) -> None:
    for key, wanted in REFUSED_KEYS.items():
        value = cfg.get(key)
        if value is None or value == wanted or (wanted is None and not value):  # absent, neutral, or empty
            continue
        rule = "only unquantized checkpoints" if key == "quantization_config" else f"only {key}={wanted!r}"
        raise PrefillConfigError(f"config.json {key}={value!r} is unsupported: the reference model computes {rule}")


GEMMA3_ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration"}
"""Gemma 3's ``model_type``s and the architecture each loads: a hybrid model only (``hybrid.load_hybrid_folder``)."""

HYBRID_LOADER = "prefill_shell.reference.load_model_folder"
"""The loader that picks the plain or the hybrid model for any supported folder (named by the plain one's errors)."""


def check_computed(cfg: dict[str, Any]) -> str:
    """The config's ``model_type``, after refusing (naming key and value) any setting the reference does not compute."""
    model_type = cfg.get("model_type") or "llama"
    family = FAMILIES.get(model_type)
    if model_type in GEMMA3_ARCHITECTURES:
        raise PrefillConfigError(
            f"config.json model_type={model_type!r} is Gemma 3, whose layers slide: the plain reference Llama does "
            f"not compute it; load the folder with {HYBRID_LOADER} (it returns a HybridLlama)"
        )
    if family is None:
        raise PrefillConfigError(
            f"config.json model_type={model_type!r} is unsupported: the reference model computes {sorted(FAMILIES)}"
        )
    for name in cfg.get("architectures") or ():
        if name != family.architecture:
            raise PrefillConfigError(
                f"config.json architectures entry {name!r} is unsupported: model_type={model_type!r} loads only "
                f"{family.architecture!r}"
            )
    _refuse_uncomputed(cfg)
    return model_type


def needs_hybrid(cfg: dict[str, Any]) -> bool:
    """Whether transformers would slide any layer of this config (Gemma 3, or a Llama-family window).

    Refuses what ``check_computed`` refuses for a Llama-family config.
    """
    if cfg.get("model_type") in GEMMA3_ARCHITECTURES:
        return True
    return bool(sliding_layers(cfg)[1])


def sliding_layers(cfg: dict[str, Any]) -> tuple[int | None, list[int]]:
    """``(window, layers it slides)`` as transformers reads a Llama-family config (``(None, [])``: none slides)."""
    family = FAMILIES[check_computed(cfg)]
    layers = _int(cfg, "num_hidden_layers")
    return _windowed_layers(cfg, family, layers, _int(cfg, "max_position_embeddings", family.default_max_position))


def _windowed_layers(
    cfg: dict[str, Any], family: _Family, num_layers: int, max_position: int
) -> tuple[int | None, list[int]]:
    """The sliding window transformers would apply and the layers it slides (none: full attention everywhere).

    Qwen2/Qwen3 honour ``sliding_window`` only with ``use_sliding_window``
    (real Qwen2.5 configs carry a window with the flag off), on the layers
    ``layer_types`` marks (by default those from ``max_window_layers`` on);
    Mistral applies ``sliding_window`` to every layer, 4096 when absent. A
    window no shorter than ``max_position_embeddings`` hides no key.
    """
    if family.window_switch is None:
        return None, []
    window = cfg["sliding_window"] if "sliding_window" in cfg else family.default_window
    if family.window_switch == "flag" and not cfg.get("use_sliding_window", False):
        window = None
    types = cfg.get("layer_types")
    if family.window_switch == "always":
        types = None  # Mistral ignores layer_types
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise PrefillConfigError(f"config.json layer_types={types!r} is invalid: needs one entry per layer")
        for entry in types:
            if entry not in ("full_attention", "sliding_attention"):
                raise PrefillConfigError(
                    f"config.json layer_types entry {entry!r} is unsupported: only 'full_attention' is computed"
                )
    if window is None:
        if types is not None and "sliding_attention" in types:
            # transformers keeps these layer types and its model raises on the first forward (no window to apply)
            why = (
                "use_sliding_window is off"
                if family.window_switch == "flag" and not cfg.get("use_sliding_window", False)
                else "sliding_window is null"
            )
            sliding = [i for i, entry in enumerate(types) if entry == "sliding_attention"]
            raise PrefillConfigError(
                f"config.json layer_types={types!r} is invalid: it marks layers {sliding} sliding_attention but {why}, "
                "so they have no window (transformers refuses this config on its first forward); set "
                "use_sliding_window and sliding_window, or mark those layers full_attention"
            )
        return None, []
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise PrefillConfigError(f"config.json sliding_window={window!r} is invalid: must be a positive integer")
    if types is None:
        first = _int(cfg, "max_window_layers", 28) if family.window_switch == "flag" else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    layers = [i for i, entry in enumerate(types) if entry == "sliding_attention"]
    return (window, layers) if layers and window < max_position else (None, [])


@attrs.frozen
class LlamaSpec:
    """Everything about a Llama-shaped checkpoint's architecture the reference model needs.

    ``family`` is the HF ``model_type`` (``llama``, ``mistral``, ``qwen2``,
    ``qwen3``); it decides only how the description is written back.
    """

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rms_norm_eps: float = attrs.field(converter=float, validator=_positive)
    rope_theta: float = attrs.field(converter=float, validator=_positive)
    rope_scaling: RopeScaling | None
    max_position_embeddings: int = attrs.field(validator=_positive)
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    family: str = "llama"
    attention: LayerAttention = LayerAttention()

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise PrefillConfigError(
                f"num_kv_heads={self.num_kv_heads!r} is invalid: must divide num_heads={self.num_heads!r}"
            )
        if self.head_dim % 2:
            raise PrefillConfigError(f"head_dim={self.head_dim!r} is invalid: RoPE needs an even head_dim")
        if self.dtype not in DTYPES:
            raise PrefillConfigError(f"dtype={self.dtype!r} is invalid: expected one of {DTYPES}")
        if self.family not in FAMILIES:
            raise PrefillConfigError(f"family={self.family!r} is invalid: expected one of {sorted(FAMILIES)}")

    def layer_attention(self, index: int) -> LayerAttention:
        """Layer ``index``'s attention options (today the same for every layer)."""
        return self.attention

    @property
    def rope_attention_factor(self) -> float:
        """The factor RoPE's cos and sin are scaled by (YaRN's; 1 otherwise)."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.attention_factor

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

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LlamaSpec:
        """Reads a parsed HF ``config.json`` of a computed family (either RoPE spelling).

        Refuses, naming the key and value, any setting the reference model
        does not compute (see ``check_computed``), an effective sliding
        window included.
        """
        if not isinstance(cfg, dict):
            raise PrefillConfigError(f"config.json holds a {type(cfg).__name__}, expected a JSON object")
        model_type = check_computed(cfg)
        family = FAMILIES[model_type]
        heads = _int(cfg, "num_attention_heads")
        hidden = _int(cfg, "hidden_size")
        layers = _int(cfg, "num_hidden_layers")
        max_position = _int(cfg, "max_position_embeddings", family.default_max_position)
        window, windowed = _windowed_layers(cfg, family, layers, max_position)
        if windowed:
            raise PrefillConfigError(
                f"config.json sliding_window={window!r} slides layers {windowed}: the plain reference Llama "
                f"computes full attention only; load the folder with {HYBRID_LOADER} (it returns a HybridLlama)"
            )
        theta, scaling = read_rope(cfg, max_position)
        default_head_dim = family.default_head_dim or (hidden // heads if heads > 0 else 0)
        return cls(
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_int(cfg, "num_key_value_heads", heads),
            head_dim=_int(cfg, "head_dim", default_head_dim),
            rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_position,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            family=model_type,
            attention=_layer_attention(model_type, cfg),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` contents the family's ``*ForCausalLM.from_pretrained`` accepts."""
        cfg: dict[str, Any] = {
            "architectures": [FAMILIES[self.family].architecture],
            "model_type": self.family,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf_dict(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.dtype,
        }
        if self.family in ("llama", "qwen3"):
            cfg["attention_bias"] = self.attention.qkv_bias
        if self.family == "llama":
            cfg["mlp_bias"] = False
        if self.family != "llama":
            cfg["sliding_window"] = None
        if self.family in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = False
        return cfg


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key) if cfg.get(key) is not None else default
    if value is None:
        raise PrefillConfigError(f"config.json lacks required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise PrefillConfigError(f"config.json {key}={value!r} is invalid: must be an integer")
    return value


def _number(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PrefillConfigError(f"config.json {key}={value!r} is invalid: must be a number")
    return float(value)


def read_config_dict(folder: str | Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict: the one reader every folder loader uses.

    A missing folder or file, an unreadable or non-UTF-8 file, text that is
    not JSON, or JSON that is not an object is a ``PrefillConfigError``
    naming the path and the fix; nothing else is read.
    """
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise PrefillConfigError(f"{folder} is not a folder: a Hugging Face model folder holds config.json")
    if not path.is_file():
        raise PrefillConfigError(f"{path} does not exist: a Hugging Face model folder needs config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PrefillConfigError(
            f"{path} is not valid JSON ({error}): restore the model folder's config.json"
        ) from None
    except OSError as error:
        raise PrefillConfigError(f"{path} cannot be read ({error.strerror or error})") from None
    if not isinstance(cfg, dict):
        raise PrefillConfigError(f"{path} holds a JSON {type(cfg).__name__}, expected an object of config keys")
    return cfg


def read_config_json(folder: str | Path) -> LlamaSpec:
    """Parses ``folder/config.json`` into a ``LlamaSpec``."""
    cfg = read_config_dict(folder)
    try:
        return LlamaSpec.from_hf_dict(cfg)
    except PrefillConfigError as error:
        raise in_folder(folder, error) from None


def in_folder(folder: str | Path, error: PrefillConfigError) -> PrefillConfigError:
    """``error`` naming ``folder``'s config.json: a config reader's message alone does not say which folder."""
    path = Path(folder) / "config.json"
    message = str(error)
    if message.startswith("config.json "):
        return PrefillConfigError(f"{path} {message[len('config.json ') :]}")
    return PrefillConfigError(f"{path}: {message}")
