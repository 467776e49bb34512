"""vLLM 0.33's own scheduler and KV cache planning, configured as the Tenstorrent plugin's platform runs them.

``VllmConfig`` over the checkpoint folder (the model is inspected, never
run: ``skip_tokenizer_init``), the hybrid KV cache manager on (the plugin's
platform keeps it on; this CPU platform would turn it off), the KV layout
fixed where the engine core would resolve it, and one KV spec per layer as
the plugin's ``get_kv_cache_spec`` builds them (``SlidingWindowSpec`` for a
sliding layer, ``FullAttentionSpec`` else). vLLM then forms the groups
(``get_kv_cache_groups``), plans the tensors for a given number of blocks
(``get_kv_cache_config_from_groups``) and schedules (``Scheduler`` with its
``KVCacheManager``, prefix caching on, chunked prefill under a token budget).
"""

from __future__ import annotations

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.structured_output import StructuredOutputManager

from tests.vllm.checkpoints import ARCHITECTURES, BLOCK, WINDOW, S, checkpoint

MAX_MODEL_LEN = 256


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def vllm_setup(
    name: str,
    spec,
    *,
    num_blocks: int,
    token_budget: int,
    max_num_seqs: int,
    per_request_tokens=0,
    reserve_full_prompt=True,
):
    """``(scheduler, kv_cache_config)`` for architecture ``name`` with a pool of ``num_blocks`` blocks."""
    folder, _ = checkpoint(name)
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    scheduler = SchedulerConfig(
        max_num_batched_tokens=token_budget,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=per_request_tokens,
        scheduler_reserve_full_isl=reserve_full_prompt,
        is_encoder_decoder=False,
    )
    config = VllmConfig(
        model_config=model, cache_config=cache, scheduler_config=scheduler, device_config=DeviceConfig(device="cpu")
    )
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.cache_config.kv_cache_layout = "LBHNC"  # layer-outer, as the plugin's per-layer tensors are
    specs = {}
    for layer, kind in enumerate(ARCHITECTURES[name]):
        common = dict(block_size=BLOCK, num_kv_heads=spec.num_kv_heads, head_size=spec.head_dim, dtype=torch.float32)
        specs[layer_name(layer)] = (
            SlidingWindowSpec(**common, sliding_window=WINDOW) if kind == S else FullAttentionSpec(**common)
        )
    groups = get_kv_cache_groups(config, specs)
    page = next(iter(specs.values())).page_size_bytes
    tensors = max(len(g.layer_names) for g in groups)
    kv_config = get_kv_cache_config_from_groups(config, groups, num_blocks * page * tensors)
    assert kv_config.num_blocks == num_blocks
    config.cache_config.num_gpu_blocks = kv_config.num_blocks
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BLOCK, log_stats=True), kv_config


def block_hasher():
    """The engine core's prefix-cache hasher (``EngineCore.__init__``: sha256 over CBOR, the default)."""
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


def layer_groups(kv_config) -> tuple[tuple[int, ...], ...]:
    """vLLM's groups as layer indices, in its group order."""
    index = {layer_name(i): i for i in range(1000)}
    return tuple(tuple(sorted(index[n] for n in g.layer_names)) for g in kv_config.kv_cache_groups)


def tensor_index_of(kv_config) -> dict[int, int]:
    """Each layer's KV tensor index as vLLM 0.33 plans it: its position in its tensor's ``layers`` (at
    ``offset + position * layer_stride``; every group's tensor starts at byte 0, so position i of every group
    is one memory region: the plugin's per-layer tensor index)."""
    index = {layer_name(i): i for i in range(1000)}
    return {index[n]: position for t in kv_config.kv_cache_tensors for position, n in enumerate(t.layers)}


def planned_bytes(kv_config) -> int:
    """The bytes vLLM plans: its tensors alias from byte 0, so the largest ``offset + size``."""
    return max(t.offset + t.size for t in kv_config.kv_cache_tensors)
