"""The serving layer: the generator facade vLLM's Tenstorrent plugin calls.

``facade`` holds ``ServingFacade`` (``prefill_forward``, ``warmup_model_prefill``,
``allocate_kv_cache``, ``model_capabilities``) over one executor;
``lane_facade`` the same surface over a ``LaneGroup``; ``plugin_sampling``
turns the plugin's ``TTSamplingParams`` into per-row sampling values.
Independent of ``prefill_shell.scoring``.
"""

from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.lane_facade import LaneGroupFacade

__all__ = ["LaneGroupFacade", "ServingFacade"]
