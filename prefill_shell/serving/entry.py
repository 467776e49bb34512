"""``serving_facade``: the one way in for a serving engine, whatever the model's attention and lane count.

Two independent axes: KV groups (a model with ``attention``: sliding windows,
Gemma 3, Qwen3 with ``layer_types``; ``hybrid_facade.KVGroups`` takes vLLM's
groups at allocation) and lanes (one, or one per data-parallel rank:
``lane_facade``). ``serving_facade`` picks the facade for both: every one
takes the plugin's calls alike; pick a class by hand only to pin one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefill_core.values.errors import PrefillConfigError
from prefill_shell.serving.facade import PluginFacade, ServingFacade
from prefill_shell.serving.hybrid_facade import HybridLaneGroupFacade, HybridServingFacade
from prefill_shell.serving.lane_facade import LaneGroupFacade

__all__ = ["serving_facade"]


def serving_facade(model: Any = None, backend: Any = None, *, lanes: Sequence | None = None, **kwargs: Any):
    """The facade for ``model`` on ``backend`` (one lane), or for ``lanes`` (one ``(model, backend)`` pair per
    data-parallel lane); a model with KV groups gets the KV-group facade of that lane count.

    ``kwargs`` are the chosen facade's (``ServingFacade``'s ``max_batch_size`` is a lane group's
    ``policy.lane_size``). Give either ``model`` and ``backend`` or ``lanes``: anything else is a
    ``PrefillConfigError`` naming it.
    """
    if lanes is not None:
        if model is not None or backend is not None:
            raise PrefillConfigError("serving_facade: give model and backend (one lane) or lanes=, not both")
        if not isinstance(lanes, Sequence) or not lanes or not isinstance(lanes[0], (tuple, list)):
            raise PrefillConfigError("serving_facade: lanes= must be a non-empty list of (model, backend) pairs")
        grouped = getattr(lanes[0][0], "attention", None) is not None
        facade: PluginFacade = (HybridLaneGroupFacade if grouped else LaneGroupFacade)(lanes, **kwargs)
        return facade
    if model is None or backend is None:
        raise PrefillConfigError("serving_facade: give model and backend (one lane) or lanes=[(model, backend), ...]")
    if getattr(model, "attention", None) is not None:
        return HybridServingFacade(model, backend, **kwargs)
    return ServingFacade(model, backend, **kwargs)
