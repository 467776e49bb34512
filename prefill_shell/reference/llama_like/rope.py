"""RoPE frequency scalings the reference model computes, read from HF config keys.

Computed: ``default`` (no scaling), ``linear`` (every frequency divided by
``factor``), ``llama3`` (long wavelengths slowed, a smooth band between) and
``yarn`` (a ramp between interpolated and extrapolated frequencies, plus an
attention factor that scales cos and sin). Every other ``rope_type``
(``dynamic``, ``longrope``, ...) is refused by name: ``dynamic`` and
``longrope`` change frequencies with the sequence length a call sees, which a
paged prefill whose rows are split into chunks cannot reproduce per call.

Two spellings reach this module: the long-standing ``rope_theta`` plus a
``rope_scaling`` dict, and transformers 5's ``rope_parameters`` dict (which
also carries ``rope_theta``). ``read_rope`` takes either; ``to_hf_dict``
writes the long-standing one, which every transformers release reads.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from prefill_core.values.errors import PrefillConfigError

__all__ = [
    "COMPUTED_ROPE_TYPES",
    "Llama3RopeScaling",
    "LinearRopeScaling",
    "RopeScaling",
    "YarnRopeScaling",
    "read_rope",
    "rope_inv_freq",
]

COMPUTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _positive(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value <= 0:
        raise PrefillConfigError(f"rope_scaling.{attribute.name}={value!r} is invalid: must be positive")


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # float32 exactly as transformers computes it, so both sides round alike.
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@attrs.frozen
class LinearRopeScaling:
    """Position interpolation (``rope_type: linear``): every frequency divided by ``factor``."""

    factor: float = attrs.field(converter=float, validator=_positive)
    attention_factor = 1.0

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        return _base_inv_freq(theta, dim) / self.factor

    def to_hf_dict(self) -> dict[str, Any]:
        return {"rope_type": "linear", "factor": self.factor}


@attrs.frozen
class Llama3RopeScaling:
    """Llama-3 RoPE frequency scaling (``rope_type: llama3``)."""

    factor: float = attrs.field(converter=float, validator=_positive)
    low_freq_factor: float = attrs.field(converter=float, validator=_positive)
    high_freq_factor: float = attrs.field(converter=float, validator=_positive)
    original_max_position_embeddings: int = attrs.field(converter=int, validator=_positive)
    attention_factor = 1.0

    def __attrs_post_init__(self) -> None:
        # The smoothing ramp divides by (high - low); equal factors would make it 0/0.
        if self.high_freq_factor <= self.low_freq_factor:
            raise PrefillConfigError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor!r} is invalid: "
                f"must exceed low_freq_factor={self.low_freq_factor!r}"
            )

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        inv_freq = _base_inv_freq(theta, dim)
        old_len = self.original_max_position_embeddings
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
        # and the band between is a linear blend so the spectrum stays continuous.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        ramp = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - ramp) * scaled / self.factor + ramp * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(in_band, blended, scaled)

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@attrs.frozen
class YarnRopeScaling:
    """YaRN (``rope_type: yarn``), with its attention factor already resolved to one number.

    ``attention_factor`` multiplies cos and sin (so every attention score by
    its square); a config that omits it gets transformers' rule from
    ``factor``, ``mscale`` and ``mscale_all_dim`` at read time.
    """

    factor: float = attrs.field(converter=float, validator=_positive)
    original_max_position_embeddings: int = attrs.field(converter=int, validator=_positive)
    attention_factor: float = attrs.field(converter=float, validator=_positive)
    beta_fast: float = attrs.field(default=32.0, converter=float)
    beta_slow: float = attrs.field(default=1.0, converter=float)
    truncate: bool = True

    def inv_freq(self, theta: float, dim: int) -> torch.Tensor:
        pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            # The dimension whose wavelength fits `rotations` turns into the original context.
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low ones)
        return interpolated * (1 - keep) + extrapolated * keep

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "rope_type": "yarn",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "attention_factor": self.attention_factor,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "truncate": self.truncate,
        }


RopeScaling = LinearRopeScaling | Llama3RopeScaling | YarnRopeScaling


def rope_inv_freq(theta: float, dim: int, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies ``[dim // 2]`` (float32), scaled as configured."""
    return _base_inv_freq(theta, dim) if scaling is None else scaling.inv_freq(theta, dim)


def _first_given(*values: Any) -> Any:
    """The first value that is not None (a key transformers finds in its first place wins)."""
    return next(v for v in values if v is not None)


def _number(table: dict[str, Any], key: str, default: float | None = None) -> float:
    value = table.get(key, default) if table.get(key) is not None else default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PrefillConfigError(f"config.json rope_scaling.{key}={value!r} is invalid: must be a number")
    return float(value)


def _yarn_attention_factor(scaling: dict[str, Any], factor: float) -> float:
    """transformers' default: ``0.1 * ln(factor) + 1``, or the mscale ratio when both mscales are given."""
    if scaling.get("attention_factor") is not None:
        return _number(scaling, "attention_factor")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, _number(scaling, "mscale")) / mscale(factor, _number(scaling, "mscale_all_dim"))
    return mscale(factor)


def read_rope(cfg: dict[str, Any], max_position: int) -> tuple[float, RopeScaling | None]:
    """Returns ``(theta, scaling)`` from either spelling, as transformers 5 resolves them; a type not computed is
    refused by name.

    transformers' precedence (``convert_rope_params_to_dict`` and
    ``standardize_rope_params``): a non-empty legacy ``rope_scaling`` replaces
    ``rope_parameters`` whole; inside the table that stands, ``rope_theta``
    and ``partial_rotary_factor`` win over the top-level keys, which are only
    defaults (then 10000 and 1). The pretraining length of llama3 and yarn is
    the other way round: a top-level ``original_max_position_embeddings``
    beats the table's (the RoPE initialisers re-standardise once the config
    holds it as an attribute), else ``max_position_embeddings``.
    """
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise PrefillConfigError("config.json rope_parameters / rope_scaling is invalid: must be a JSON object")
    scaling = legacy or params
    theta = _first_given(scaling.get("rope_theta"), cfg.get("rope_theta"), 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise PrefillConfigError(f"config.json rope_theta={theta!r} is invalid: must be a positive number")
    partial = _first_given(scaling.get("partial_rotary_factor"), cfg.get("partial_rotary_factor"), 1.0)
    if partial not in (None, 1, 1.0):
        raise PrefillConfigError(
            f"config.json partial_rotary_factor={partial!r} is unsupported: RoPE over the whole head only"
        )
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in COMPUTED_ROPE_TYPES:
        raise PrefillConfigError(
            f"config.json rope_scaling.rope_type={kind!r} is unsupported: only {COMPUTED_ROPE_TYPES} are computed"
        )
    original = _first_given(
        cfg.get("original_max_position_embeddings"), scaling.get("original_max_position_embeddings"), max_position
    )
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), LinearRopeScaling(_number(scaling, "factor"))
    if kind == "llama3":
        return float(theta), Llama3RopeScaling(
            _number(scaling, "factor"),
            _number(scaling, "low_freq_factor"),
            _number(scaling, "high_freq_factor"),
            int(_number({"original_max_position_embeddings": original}, "original_max_position_embeddings")),
        )
    factor = _number(scaling, "factor", max_position / original)
    return float(theta), YarnRopeScaling(
        factor,
        int(original),
        _yarn_attention_factor(scaling, factor),
        scaling.get("beta_fast") or 32.0,
        scaling.get("beta_slow") or 1.0,
        bool(scaling.get("truncate", True)),
    )
