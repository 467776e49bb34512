"""The Llama architecture description, read from and written to HF ``config.json``.

Two on-disk spellings of RoPE settings exist: the long-standing one
(``rope_theta`` at top level plus a ``rope_scaling`` dict) and the newer
``rope_parameters`` dict that also carries ``rope_theta``. Both are read;
the long-standing one is written because every transformers release reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from prefill_core.dtype import DTYPES
from prefill_core.errors import PrefillConfigError
from prefill_shell.device.model import ModelSpec

__all__ = ["Llama3RopeScaling", "LlamaSpec", "check_plain_llama", "read_config_json"]


def _positive(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value <= 0:
        raise PrefillConfigError(f"{attribute.name}={value!r} is invalid: must be positive")


@attrs.frozen
class Llama3RopeScaling:
    """Llama-3 RoPE frequency scaling (``rope_type: llama3``)."""

    factor: float = attrs.field(converter=float, validator=_positive)
    low_freq_factor: float = attrs.field(converter=float, validator=_positive)
    high_freq_factor: float = attrs.field(converter=float, validator=_positive)
    original_max_position_embeddings: int = attrs.field(converter=int, validator=_positive)

    def __attrs_post_init__(self) -> None:
        # The smoothing ramp divides by (high - low); equal factors would make it 0/0.
        if self.high_freq_factor <= self.low_freq_factor:
            raise PrefillConfigError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor!r} is invalid: "
                f"must exceed low_freq_factor={self.low_freq_factor!r}"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``rope_scaling`` dict as HF writes it."""
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@attrs.frozen
class LlamaSpec:
    """Everything about a Llama checkpoint's architecture the reference model needs."""

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rms_norm_eps: float = attrs.field(converter=float, validator=_positive)
    rope_theta: float = attrs.field(converter=float, validator=_positive)
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int = attrs.field(validator=_positive)
    tie_word_embeddings: bool = False
    dtype: str = "float32"

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise PrefillConfigError(
                f"num_kv_heads={self.num_kv_heads!r} is invalid: must divide num_heads={self.num_heads!r}"
            )
        if self.head_dim % 2:
            raise PrefillConfigError(f"head_dim={self.head_dim!r} is invalid: RoPE needs an even head_dim")
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

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LlamaSpec:
        """Reads a parsed HF Llama ``config.json`` (either RoPE spelling).

        Refuses, naming the key and value, any setting the reference Llama
        does not compute (see ``check_plain_llama``).
        """
        if not isinstance(cfg, dict):
            raise PrefillConfigError(f"config.json holds a {type(cfg).__name__}, expected a JSON object")
        check_plain_llama(cfg)
        heads = _int(cfg, "num_attention_heads")
        hidden = _int(cfg, "hidden_size")
        theta, scaling = _read_rope(cfg)
        return cls(
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_int(cfg, "num_key_value_heads", heads),
            head_dim=_int(cfg, "head_dim", hidden // heads if heads > 0 else 0),
            rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_int(cfg, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` contents ``LlamaForCausalLM.from_pretrained`` accepts."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
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


# What the reference Llama computes, as HF config keys: a checkpoint that says
# otherwise (another activation, biases, another architecture) would load and
# give different logits, so it is refused. Absent keys take HF Llama's defaults.
_PLAIN_LLAMA = {
    "model_type": ("llama", "llama"),
    "hidden_act": ("silu", "silu"),
    "attention_bias": (False, False),
    "mlp_bias": (False, False),
}
_UNSUPPORTED_KEYS = ("quantization_config",)


def check_plain_llama(cfg: dict[str, Any]) -> None:
    """Raises ``PrefillConfigError`` naming the key and value of any setting the reference Llama does not compute."""
    for key, (default, wanted) in _PLAIN_LLAMA.items():
        value = default if cfg.get(key) is None else cfg[key]
        if value != wanted:
            raise PrefillConfigError(
                f"config.json {key}={value!r} is unsupported: the reference model computes only {key}={wanted!r}"
            )
    for name in cfg.get("architectures") or ():
        if name != "LlamaForCausalLM":
            raise PrefillConfigError(
                f"config.json architectures entry {name!r} is unsupported: only 'LlamaForCausalLM' loads"
            )
    for key in _UNSUPPORTED_KEYS:
        if cfg.get(key):
            raise PrefillConfigError(f"config.json {key} is unsupported: only unquantized checkpoints load")


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


def _read_rope(cfg: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Returns (theta, scaling) from either the legacy or the ``rope_parameters`` spelling."""
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise PrefillConfigError("config.json rope_parameters / rope_scaling is invalid: must be a JSON object")
    theta = _number(cfg, "rope_theta", _number(params, "rope_theta", 10000.0))
    scaling = {**params, **legacy}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise PrefillConfigError(
            f"config.json rope_scaling.rope_type={kind!r} is unsupported: only 'default' and 'llama3' are computed"
        )
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for name in fields:
        value = scaling.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PrefillConfigError(
                f"config.json rope_scaling.{name}={value!r} is invalid: llama3 scaling needs a number"
            )
    return theta, Llama3RopeScaling(**{name: scaling[name] for name in fields})


def read_config_json(folder: str | Path) -> LlamaSpec:
    """Parses ``folder/config.json`` into a ``LlamaSpec``."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise PrefillConfigError(f"{path} does not exist: a Hugging Face model folder needs config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PrefillConfigError(
            f"{path} is not valid JSON ({error}): restore the model folder's config.json"
        ) from None
    try:
        return LlamaSpec.from_hf_dict(cfg)
    except PrefillConfigError as error:  # name the file: the message alone does not say which folder
        message = str(error)
        named = (
            f"{path} {message[len('config.json ') :]}" if message.startswith("config.json ") else f"{path}: {message}"
        )
        raise PrefillConfigError(named) from None
