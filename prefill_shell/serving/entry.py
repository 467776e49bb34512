"""``serving_facade``: the one way in for a serving engine, whatever the model's attention.

A model with KV groups (``attention``: sliding windows, Gemma 3, Qwen3 with
``layer_types``) is served by ``HybridServingFacade``, which takes vLLM's
groups at allocation; any other by ``ServingFacade``. Both take the same
keywords and make the plugin's calls; pick by hand only to pin one.
"""

from __future__ import annotations

from typing import Any

from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.hybrid_facade import HybridServingFacade

__all__ = ["serving_facade"]


def serving_facade(model: Any, backend: Any, **kwargs: Any) -> ServingFacade:
    """``HybridServingFacade(model, backend, **kwargs)`` for a model with KV groups, else ``ServingFacade``."""
    if getattr(model, "attention", None) is not None:
        return HybridServingFacade(model, backend, **kwargs)
    return ServingFacade(model, backend, **kwargs)
