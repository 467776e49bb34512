"""vLLM 0.33's real ``Scheduler``, ``KVCacheManager`` and ``get_kv_cache_groups`` drive the facade as the plugin does.

Gemma 3 at 2:1 (6 layers: three groups of two) and 5:1 (12 layers: six
groups of two), a Qwen3 hybrid (two groups of one), Mistral with a window on
every layer and a full-attention Llama (one group each): prefix caching on,
chunked prefill under a small token budget, a small pool (preemptions counted, not forced),
eager and traced. Every finished request equals transformers' one-shot
forward of its prompt (logits and kept KV within 1e-4) and no KV byte outside
each step's written blocks changes (``plugin_runner``). Runs under
``make test-vllm`` (vLLM installed ``--no-deps`` over the project venv).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` builds the venv that has it")

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from prefill_core import PrefillPolicy, vllm_layer_groups
from prefill_shell.backends.torch_backend import TorchBackend
from prefill_shell.serving import HybridServingFacade, serving_facade
from tests.vllm import vllm_side
from tests.vllm.checkpoints import ARCHITECTURES, BLOCK, checkpoint, project_model
from tests.vllm.plugin_runner import PluginRunner

SEQS = 4
MAX_BLOCKS = vllm_side.MAX_MODEL_LEN // BLOCK
POLICY = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4), lane_size=SEQS)
WORKLOADS = {
    # name: (token budget, pool blocks, waves of prompt lengths; a later wave shares the first prompt's prefix)
    "prefix-hits": (48, 64, [[100], [90, 120]]),
    "concurrent-chunks": (40, 64, [[70, 45, 130, 58]]),
    "small-pool": (64, None, [[120, 110, 100]]),  # None: 9 blocks per KV group, about one request's worth
}
STATS: dict[tuple[str, str, str], dict] = {}


def _block_hasher():
    """The engine core's prefix-cache hasher (``EngineCore.__init__``: sha256 over CBOR, the default)."""
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


def _requests(workload: str, vocab: int):
    gen = torch.Generator().manual_seed(len(workload))
    hasher = _block_hasher()
    shared = torch.randint(1, vocab, (80,), generator=gen)
    waves, count = [], 0
    for wave in WORKLOADS[workload][2]:
        reqs = []
        for n in wave:
            tail = torch.randint(1, vocab, (max(n - 80, 0),), generator=gen)
            prompt = (
                torch.cat((shared, tail))[:n]
                if workload == "prefix-hits"
                else torch.randint(1, vocab, (n,), generator=gen)
            )
            params = SamplingParams(max_tokens=1)
            reqs.append(Request(f"r{count}", prompt.tolist(), params, None, block_hasher=hasher))
            count += 1
        waves.append(reqs)
    return waves


def _facade_and_pool(name, model, kv_config):
    facade = serving_facade(
        model, TorchBackend(), max_seq_len=vllm_side.MAX_MODEL_LEN, max_batch_size=SEQS, policy=POLICY
    )
    spec = model.spec
    shape = (kv_config.num_blocks, spec.num_kv_heads, BLOCK, spec.head_dim)
    if isinstance(facade, HybridServingFacade):
        index = vllm_side.tensor_index_of(kv_config)
        kv = facade.allocate_kv_cache_per_layer([(shape, model.dtype, index[i]) for i in range(spec.num_layers)])
    else:  # the plugin's legacy call for a model without allocate_kv_cache_per_layer
        kv = facade.allocate_kv_cache(shape, model.dtype, spec.num_layers)
    return facade, kv


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_vllms_scheduler_through_the_facade_equals_transformers(name, workload, enable_trace):
    model = project_model(name)
    budget, num_blocks, _ = WORKLOADS[workload]
    num_blocks = num_blocks or 9 * len(vllm_layer_groups(ARCHITECTURES[name])) + 2
    scheduler, kv_config = vllm_side.vllm_setup(
        name, model.spec, num_blocks=num_blocks, token_budget=budget, max_num_seqs=SEQS
    )
    facade, kv = _facade_and_pool(name, model, kv_config)
    groups = vllm_side.layer_groups(kv_config)
    if isinstance(facade, HybridServingFacade):
        assert facade.model.attention.layer_groups == groups  # the facade formed vLLM's groups itself
        assert kv.allocated_bytes() == vllm_side.planned_bytes(kv_config)  # and holds the memory vLLM planned
    facade.warmup_model_prefill(kv_cache=kv, can_sample_on_device=False, enable_trace=enable_trace)
    _, oracle = checkpoint(name)
    runner = PluginRunner(
        facade, kv, scheduler, oracle, enable_trace=enable_trace, max_num_seqs=SEQS, max_blocks=MAX_BLOCKS
    )
    for wave in _requests(workload, model.spec.vocab_size):
        for request in wave:
            runner.add(request)
        runner.run()
    stats = runner.stats
    assert stats.finished == sum(len(w) for w in WORKLOADS[workload][2])
    if workload == "prefix-hits":
        assert stats.prefix_hit_tokens > 0
    buffers = len({*vllm_side.tensor_index_of(kv_config).values()})
    STATS[(name, workload, "traced" if enable_trace else "eager")] = dict(
        groups=len(groups), buffers=buffers, **vars(stats)
    )
    facade.cleanup()


def test_the_core_forms_the_groups_vllm_forms():
    """``prefill_core.vllm_layer_groups`` against vLLM's own ``get_kv_cache_groups`` for every architecture."""
    for name, types in ARCHITECTURES.items():
        _, kv_config = vllm_side.vllm_setup(
            name, project_model(name).spec, num_blocks=16, token_budget=32, max_num_seqs=SEQS
        )
        assert vllm_layer_groups(types) == vllm_side.layer_groups(kv_config), name
