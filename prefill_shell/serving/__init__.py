"""The serving layer: the generator facade vLLM's Tenstorrent plugin calls.

``serving_facade`` (``entry``) is the one way in: it picks ``ServingFacade``
or, for a model with KV groups, ``HybridServingFacade`` (``hybrid_facade``).
``facade`` holds ``ServingFacade`` (``prefill_forward``, ``warmup_model_prefill``,
``allocate_kv_cache``, ``model_capabilities``) over one executor;
``lane_facade`` the same surface over a ``LaneGroup``; ``plugin_sampling``
turns the plugin's ``TTSamplingParams`` into per-row sampling values;
``pooled_output`` checks a call's pooling requests and builds vLLM's
``pooler_output``.
Independent of ``prefill_shell.scoring``.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch

from prefill_shell.serving.entry import serving_facade
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.hybrid_facade import HybridLaneGroupFacade, HybridServingFacade
from prefill_shell.serving.lane_facade import LaneGroupFacade

__all__ = ["HybridLaneGroupFacade", "HybridServingFacade", "LaneGroupFacade", "ServingFacade", "serving_facade"]
