"""``build_runtime``: the one way the shipped test tools and the project's tests build a runtime.

A test names only what it varies (the model, the pool's size, a policy, a
backend, a layout); everything else is the plain default, so two tests that
build "a runtime of this model" build the same one.
"""

from __future__ import annotations

from prefill_core import PageTableLayout, PrefillPolicy

from ..backends import TorchBackend
from ..engine.config import PrefillRuntimeConfig
from ..engine.runtime import PrefillRuntime

__all__ = ["build_runtime"]


def build_runtime(
    model,
    *,
    num_blocks: int | None = None,
    block_size: int | None = None,
    policy: PrefillPolicy | None = None,
    backend=None,
    layout: PageTableLayout | None = None,
    kv=None,
    seed: int = 0,
) -> PrefillRuntime:
    """A runtime of ``model``; its pool is ``runtime.config.kv``.

    ``kv`` defaults to a fresh zeroed pool of ``model`` (``num_blocks`` x
    ``block_size``, by default ``layout``'s), ``layout`` to the one the config
    derives from the pool, ``backend`` to a CPU ``TorchBackend``, ``policy`` to
    the one ``PrefillRuntimeConfig.resolve`` chooses for the backend.
    """
    if kv is None:
        num_blocks = layout.num_blocks if num_blocks is None else num_blocks
        block_size = layout.block_size if block_size is None else block_size
        kv = model.new_kv_cache(num_blocks, block_size)
    backend = TorchBackend() if backend is None else backend
    config = PrefillRuntimeConfig.resolve(model, backend, kv, layout=layout, policy=policy)
    return PrefillRuntime(config, seed=seed)
