"""How vLLM's hybrid KV cache manager puts a model's layers into KV groups, as a pure function.

vLLM 0.33 (``v1/core/kv_cache_planning.py``, the uniform-page-size path
every model here takes: one head count, head size and dtype on every layer)
does not make one group per attention type. It makes groups of an *equal
number of layers*, so that one KV tensor per position in a group can serve
every group (tensor i holds layer i of each group; a block id belongs to one
group at a time):

1. Layers are bucketed by their KV spec (kind, window, block size), buckets
   in order of first appearance, layers in order inside a bucket. A model
   whose layers share one spec is one group (Llama; Mistral with a window
   on every layer).
2. The group size is the smallest bucket's size, or the largest bucket's
   when that is under 1.5x the smallest (fewer padding layers).
3. Each bucket of n layers splits into ``ceil(n / size)`` groups, group i
   taking the bucket's layers ``i, i + k, i + 2k, ...`` (k groups), so a
   pipeline stage's share of each group stays balanced.

So Gemma 3's sliding, sliding, full is three groups of one layer (group 0
slides), its 5:1 pattern over 12 layers is five sliding groups of two and one
full group of two, and groups need not come in order of their first layer
(sliding, full, sliding, sliding gives [0], [2], [3], [1]).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from prefill_core.values.intmath import ceil_div

__all__ = ["vllm_layer_groups"]


def vllm_layer_groups(layer_specs: Sequence[Hashable]) -> tuple[tuple[int, ...], ...]:
    """The layer indices of each KV group vLLM forms for layers with these specs (the module's rules).

    ``layer_specs[i]`` is anything equal exactly when layers i and j would get
    equal KV specs from vLLM (here: kind, window and block size).
    """
    buckets: dict[Hashable, list[int]] = {}
    for layer, spec in enumerate(layer_specs):
        buckets.setdefault(spec, []).append(layer)
    if not buckets:
        return ()
    sizes = [len(layers) for layers in buckets.values()]
    smallest, largest = min(sizes), max(sizes)
    size = largest if 2 * largest < 3 * smallest else smallest
    groups: list[tuple[int, ...]] = []
    for layers in buckets.values():
        count = ceil_div(len(layers), size)
        groups.extend(tuple(layers[i::count]) for i in range(count))
    return tuple(groups)
