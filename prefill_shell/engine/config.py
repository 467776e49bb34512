"""``PrefillRuntimeConfig``: the static collaborators of one runtime, validated once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from prefill_core import PageTableLayout, PrefillPolicy, ceil_div
from prefill_core.values.errors import PrefillConfigError, PrefillInputError
from prefill_core.values.policy import check_policy_fits_layout
from prefill_shell.backends.base import Backend
from prefill_shell.device.model import ModelSpec, PrefillModel, supports_chunked_waves, supports_packed

__all__ = ["PrefillRuntimeConfig", "DISABLE_BATCHED_PREFILL", "batching_disabled"]

DISABLE_BATCHED_PREFILL = "DISABLE_BATCHED_PREFILL"
"""tt-transformers' switch: any non-empty value turns batched prefill off (its runtime reads it the same way)."""


def batching_disabled(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` turns batched prefill off: ``DISABLE_BATCHED_PREFILL`` set to anything but ""."""
    return bool(environ.get(DISABLE_BATCHED_PREFILL))


def _config_error(field: str, value: object, rule: str) -> PrefillConfigError:
    return PrefillConfigError(f"PrefillRuntimeConfig.{field}={value!r} is invalid: {rule}")


def _fit_capabilities(policy: PrefillPolicy, backend: Backend) -> PrefillPolicy:
    """``policy`` within what the backend declares: a device top-k cap above the backend's is refused;
    sampled waves wider than one device-sampling call serves are capped (``max_sampled_wave``), so
    sampled rows run in smaller waves or alone: tt-transformers' fallback to singles, not a refusal."""
    device_cap = backend.max_device_top_k
    if device_cap is not None and policy.device_top_k_cap > device_cap:
        rule = f"must be <= the backend's max_device_top_k={device_cap}; larger top_k rows sample on the host"
        raise _config_error("policy.device_top_k_cap", policy.device_top_k_cap, rule)
    wave_cap = backend.max_sampled_wave
    largest = max((w for w in policy.waves if w <= min(policy.max_batch_size, policy.lane_size)), default=1)
    if policy.max_sampled_wave is not None:
        largest = min(largest, policy.max_sampled_wave)
    if wave_cap is not None and largest > wave_cap:
        policy = attrs.evolve(policy, max_sampled_wave=wave_cap)
    return policy


_POOL_GEOMETRY = ("num_layers", "num_kv_heads", "head_dim")


def _check_kv_fits_model(kv: Any, spec: ModelSpec, model_dtype: torch.dtype) -> None:
    """Refuses a KV pool built for another model (layers, kv heads, head dim, torch dtype).

    Only what the pool exposes is compared: a pool bound inside a ttnn model
    exposes its geometry alone, and its storage formats are its own.
    """
    for name in _POOL_GEOMETRY:
        have, want = getattr(kv, name, None), getattr(spec, name)
        if have is not None and have != want:
            rule = f"must equal the model's {name}={want}: the pool was built for another model"
            raise _config_error(f"kv.{name}", have, rule)
    dtype = getattr(kv, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype != model_dtype:
        rule = f"must be the model's dtype {model_dtype}: the pool was built for another model"
        raise _config_error("kv.dtype", dtype, rule)


def _check_policy_fits_model(policy: PrefillPolicy, spec: ModelSpec) -> None:
    """Refuses a policy asking for more top log-probs than the vocabulary holds."""
    if policy.max_logprobs > spec.vocab_size:
        rule = f"must be <= the model's vocab_size={spec.vocab_size} (top log-probs are drawn from the vocabulary)"
        raise _config_error("policy.max_logprobs", policy.max_logprobs, rule)


@attrs.frozen
class PrefillRuntimeConfig:
    """Model, backend, KV pool, page-table layout and policy of one execution lane.

    ``layout_ceiling`` bounds ``configure_page_table_layout``: a replacement
    layout may shrink within it, never grow past what the KV pool and the
    model's positions hold.
    """

    model: Any = attrs.field(eq=False)
    backend: Any = attrs.field(eq=False)
    kv: Any = attrs.field(eq=False)
    layout: PageTableLayout
    policy: PrefillPolicy
    layout_ceiling: PageTableLayout
    packed_steps: bool = False
    """Eager calls plan packed steps: the policy asks and the backend and the model both run them."""

    @classmethod
    def resolve(
        cls,
        model: PrefillModel,
        backend: Backend,
        kv: Any,
        layout: PageTableLayout | None = None,
        policy: PrefillPolicy | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> PrefillRuntimeConfig:
        """Checks every collaborator once; raises ``PrefillConfigError`` naming what is wrong.

        A policy asking for cached rows in waves on a model that runs no
        chunked wave (``device.model.supports_chunked_waves``) plans them
        alone. ``environ`` (default ``os.environ``) is read here, once: with
        ``DISABLE_BATCHED_PREFILL`` set the policy's ``batching_enabled`` is
        False (the core never reads the environment).
        """
        if not isinstance(model, PrefillModel):
            raise _config_error(
                "model", type(model).__name__, "must implement PrefillModel (spec, dtype, forward_hidden, lm_head)"
            )
        if not isinstance(backend, Backend):
            raise _config_error("backend", type(backend).__name__, "must implement the Backend seam")
        for name in ("block_size", "num_blocks"):
            if not isinstance(getattr(kv, name, None), int):
                raise _config_error("kv", type(kv).__name__, f"must expose an int {name}")
        _check_kv_fits_model(kv, model.spec, model.dtype)
        ceiling = PageTableLayout(kv.block_size, ceil_div(model.spec.max_position, kv.block_size), kv.num_blocks)
        policy = policy or backend.preferred_policy(kv.block_size)
        _check_policy_fits_model(policy, model.spec)
        policy = _fit_capabilities(policy, backend)
        if policy.batch_cached_rows and not supports_chunked_waves(model):
            policy = attrs.evolve(policy, batch_cached_rows=False)  # cached rows run alone: singles, not a refusal
        if batching_disabled(os.environ if environ is None else environ):
            policy = attrs.evolve(policy, batching_enabled=False)
        packed = policy.packed_steps and getattr(backend, "packed_steps", False) is True and supports_packed(model)
        config = cls(model, backend, kv, layout or ceiling, policy, ceiling, packed)
        config.check_layout(config.layout)
        return config

    def check_layout(self, layout: PageTableLayout) -> None:
        """Raises ``PrefillConfigError`` unless ``layout`` fits the ceiling and the policy."""
        if not isinstance(layout, PageTableLayout):
            raise _config_error("layout", type(layout).__name__, "must be a PageTableLayout")
        ceiling = self.layout_ceiling
        if layout.block_size != ceiling.block_size:
            raise _config_error(
                "layout.block_size", layout.block_size, f"must equal the KV pool's {ceiling.block_size}"
            )
        if layout.num_blocks > ceiling.num_blocks:
            raise _config_error(
                "layout.num_blocks", layout.num_blocks, f"must be <= the KV pool's {ceiling.num_blocks}"
            )
        if layout.max_num_blocks_per_seq > ceiling.max_num_blocks_per_seq:
            rule = f"must be <= {ceiling.max_num_blocks_per_seq} (the model's max_position / block_size)"
            raise _config_error("layout.max_num_blocks_per_seq", layout.max_num_blocks_per_seq, rule)
        try:
            check_policy_fits_layout(self.policy, layout)
        except PrefillInputError as error:
            raise PrefillConfigError(str(error)) from None

    def with_layout(self, layout: PageTableLayout) -> PrefillRuntimeConfig:
        """A bounded replacement of this config holding ``layout``."""
        self.check_layout(layout)
        return attrs.evolve(self, layout=layout)
