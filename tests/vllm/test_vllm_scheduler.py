"""vLLM 0.33's real ``Scheduler``, ``KVCacheManager`` and ``get_kv_cache_groups`` drive the facade as the plugin does.

Gemma 3 at 2:1 (6 layers: three groups of two) and 5:1 (12 layers: six
groups of two), a Qwen3 hybrid (two groups of one), Mistral with a window on
every layer and a full-attention Llama (one group each): prefix caching on,
chunked prefill under a small token budget, a small pool, and preemption (four
requests admitted by their first chunk into a pool two of them fill), eager and
traced. Every finished request equals transformers' one-shot
forward of its prompt (logits and kept KV within 1e-4) and no KV byte outside
each step's written blocks changes (``plugin_runner``). Data parallel: two
DP ranks, each its own scheduler and KV cache manager over its own lane of
``serving_facade(lanes=...)``, every step's rows of both gathered into one
call (``plugin_runner.DataParallelRunner``), Gemma 3 2:1, Mistral sliding
and the Qwen3 hybrid, with the same checks in both lanes' pools. Runs under
``make test-vllm`` (vLLM installed ``--no-deps`` over the project venv).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` builds the venv that has it")

import attrs
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from prefill_core import PrefillPolicy, vllm_layer_groups
from prefill_shell.backends.torch_backend import TorchBackend
from prefill_shell.serving import HybridLaneGroupFacade, HybridServingFacade, serving_facade
from tests.vllm import vllm_side
from tests.vllm.checkpoints import ARCHITECTURES, BLOCK, S, checkpoint, project_model
from tests.vllm.plugin_runner import DataParallelRunner, PluginRunner

SEQS = 4
MAX_BLOCKS = vllm_side.MAX_MODEL_LEN // BLOCK
POLICY = PrefillPolicy(length_ladder=(32, 64), max_chunk_length=64, chunk_quantum=64, waves=(1, 2, 4), lane_size=SEQS)


class Workload(NamedTuple):
    budget: int  # max_num_batched_tokens
    per_request: int  # long_prefill_token_threshold: the most tokens one request gets a step (0: no cap)
    pool: str  # "ample": 64 blocks; "one": about one request's worth; "two": two requests' worth
    waves: list[list[int]]  # prompt lengths, a wave added once the previous one finished
    admit_by_first_chunk: bool = False  # --no-scheduler-reserve-full-isl: admit a request when its first chunk fits


WORKLOADS = {
    # a later wave shares the first prompt's 80-token prefix
    "prefix-hits": Workload(48, 0, "ample", [[100], [90, 120]]),
    "concurrent-chunks": Workload(40, 0, "ample", [[70, 45, 130, 58]]),
    "small-pool": Workload(64, 0, "one", [[120, 110, 100]]),
    # four requests admitted by their first chunk and prefilled 16 tokens a step side by side in a pool two
    # of them fill: vLLM preempts the last running one when an earlier one cannot grow, and resumes it later
    "preemption": Workload(64, 16, "two", [[128, 120, 112, 104]], admit_by_first_chunk=True),
    # packed steps: a prompt twice (vLLM's n = 2) and a third sharing its first 40 tokens, in one step, where
    # shared spans compute what they share once (prefill_core.planning.shared_spans; hybrid models: not planned)
    "shared-prompts": Workload(256, 0, "ample", [[70, 70, 60]]),
}
PACKED_WORKLOADS = {"shared-prompts"}


def _pool_blocks(name: str, pool: str) -> int:
    """Blocks in vLLM's pool (every group draws from it; block 0 is vLLM's null block)."""
    if pool == "ample":
        return 64
    types = ARCHITECTURES[name]
    groups = vllm_layer_groups(types)
    # a 128-token request holds 8 blocks in a full group and at most 3 in a sliding one (16-token window and
    # chunks at 16-token blocks); "one" keeps the earlier small pool of 9 blocks a group
    if pool == "one":
        return 9 * len(groups) + 2
    need = sum(3 if types[group[0]] == S else 8 for group in groups)
    return 2 * need + 1


STATS: dict[tuple[str, str, str], dict] = {}


def _requests(workload: str, vocab: int):
    gen = torch.Generator().manual_seed(len(workload))
    hasher = vllm_side.block_hasher()
    shared = torch.randint(1, vocab, (80,), generator=gen)
    waves, count = [], 0
    for wave in WORKLOADS[workload].waves:
        reqs = []
        for n in wave:
            tail = torch.randint(1, vocab, (max(n - 80, 0),), generator=gen)
            if workload == "prefix-hits":
                prompt = torch.cat((shared, tail))[:n]
            elif workload == "shared-prompts":  # shared[:70] twice, then its first 40 tokens and 20 of its own
                prompt = (
                    shared[:n] if n == 70 else torch.cat((shared[:40], torch.randint(1, vocab, (20,), generator=gen)))
                )
            else:
                prompt = torch.randint(1, vocab, (n,), generator=gen)
            params = SamplingParams(max_tokens=1)
            reqs.append(Request(f"r{count}", prompt.tolist(), params, None, block_hasher=hasher))
            count += 1
        waves.append(reqs)
    return waves


def _facade_and_pool(name, model, kv_config, policy=POLICY):
    facade = serving_facade(
        model, TorchBackend(), max_seq_len=vllm_side.MAX_MODEL_LEN, max_batch_size=SEQS, policy=policy
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
    work = WORKLOADS[workload]
    scheduler, kv_config = vllm_side.vllm_setup(
        name,
        model.spec,
        num_blocks=_pool_blocks(name, work.pool),
        token_budget=work.budget,
        max_num_seqs=SEQS,
        per_request_tokens=work.per_request,
        reserve_full_prompt=not work.admit_by_first_chunk,
    )
    packed = workload in PACKED_WORKLOADS
    policy = attrs.evolve(POLICY, packed_steps=True) if packed else POLICY
    facade, kv = _facade_and_pool(name, model, kv_config, policy)
    shared_writes = []
    if packed and hasattr(model, "shared_writes"):  # count the positions shared writes fill
        inner = model.forward_packed

        def forward_packed(*args, shared_writes_=shared_writes, **kwargs):
            pairs = kwargs.get("shared_writes")
            shared_writes_.append(0 if pairs is None else len(pairs))
            return inner(*args, **kwargs)

        model.forward_packed = forward_packed
    groups = vllm_side.layer_groups(kv_config)
    planned = vllm_side.planned_bytes(kv_config)
    if isinstance(facade, HybridServingFacade):
        assert facade.model.attention.layer_groups == groups  # the facade formed vLLM's groups itself
        assert kv.allocated_bytes() == planned  # and holds the memory vLLM planned
    else:  # the plain pool: vLLM's plan plus the one sink block per layer its capturable fill writes -1 into
        assert kv.allocated_bytes() == planned + planned // kv_config.num_blocks
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
    assert stats.finished == sum(map(len, work.waves))
    if workload == "prefix-hits":
        assert stats.prefix_hit_tokens > 0
    if workload == "preemption":
        assert stats.preemptions > 0, "vLLM preempted nothing: the workload no longer tests resumption"
    if packed and shared_writes and not enable_trace:
        # vLLM's manager hands the duplicate and the third row the first row's whole blocks in the same step (64
        # and 32 tokens cached, blocks the first row writes); past them the duplicate takes 64..68 and the third
        # row 32..39 from the first row's step
        assert sum(shared_writes) == 5 + 8, shared_writes

    buffers = len({*vllm_side.tensor_index_of(kv_config).values()})
    STATS[(name, workload, "traced" if enable_trace else "eager")] = dict(
        groups=len(groups), buffers=buffers, **vars(stats)
    )
    facade.cleanup()


# Each rank's waves (prompt lengths; a wave added on every rank once every rank finished the previous one). A
# rank's prompts share an 80-token prefix of its own, so its later wave hits its own prefix cache; the ranks'
# waves take different numbers of steps, so some calls hold one rank's rows, others both ranks'.
DP_WAVES = [[[100], [90, 120]], [[60, 130, 70], [110, 45]]]
DP_ARCHITECTURES = ["gemma3-2to1", "mistral-sliding", "qwen3-hybrid"]


def _dp_requests(rank: int, vocab: int):
    gen = torch.Generator().manual_seed(100 + rank)
    hasher = vllm_side.block_hasher()
    shared = torch.randint(1, vocab, (80,), generator=gen)
    waves = []
    for w, wave in enumerate(DP_WAVES[rank]):
        prompts = [torch.cat((shared, torch.randint(1, vocab, (max(n - 80, 0),), generator=gen)))[:n] for n in wave]
        waves.append(
            [
                Request(f"dp{rank}-w{w}-r{i}", p.tolist(), SamplingParams(max_tokens=1), None, block_hasher=hasher)
                for i, p in enumerate(prompts)
            ]
        )
    return waves


@pytest.mark.parametrize("enable_trace", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("name", DP_ARCHITECTURES)
def test_data_parallel_ranks_share_one_call_on_two_lanes_and_equal_transformers(name, enable_trace):
    """vLLM data parallelism over ``serving_facade(lanes=...)``: each DP rank its own vLLM scheduler and KV cache
    manager over its own lane's pool (both lanes allocated from vLLM's same per-layer specs); each step the
    runner gathers both ranks' rows into one ``prefill_forward`` (``empty_slots = rank * max_num_seqs + slot``,
    each rank's tables in its own pool's ids: the ranks hand out the same block ids). Every finished request
    equals transformers' one-shot forward, and no KV byte outside a step's written blocks changes in either
    lane's pool."""
    model = project_model(name)
    ranks = len(DP_WAVES)
    setups = [
        vllm_side.vllm_setup(name, model.spec, num_blocks=64, token_budget=48, max_num_seqs=SEQS) for _ in range(ranks)
    ]
    schedulers = [scheduler for scheduler, _ in setups]
    kv_config = setups[0][1]
    facade = serving_facade(
        lanes=[(model, TorchBackend()) for _ in range(ranks)], max_seq_len=vllm_side.MAX_MODEL_LEN, policy=POLICY
    )
    assert isinstance(facade, HybridLaneGroupFacade) and facade.num_lanes == ranks
    spec = model.spec
    shape = (kv_config.num_blocks, spec.num_kv_heads, BLOCK, spec.head_dim)
    index = vllm_side.tensor_index_of(kv_config)
    pools = facade.allocate_kv_cache_per_layer([(shape, model.dtype, index[i]) for i in range(spec.num_layers)])
    assert len(pools) == ranks and len({id(pool) for pool in pools}) == ranks
    groups = vllm_side.layer_groups(kv_config)
    assert all(runtime.config.model.attention.layer_groups == groups for runtime in facade.runtimes)
    assert all(pool.allocated_bytes() == vllm_side.planned_bytes(kv_config) for pool in pools)
    facade.warmup_model_prefill(kv_cache=pools, can_sample_on_device=False, enable_trace=enable_trace)
    _, oracle = checkpoint(name)
    runner = DataParallelRunner(
        facade, pools, schedulers, oracle, enable_trace=enable_trace, max_num_seqs=SEQS, max_blocks=MAX_BLOCKS
    )
    waves = [_dp_requests(rank, spec.vocab_size) for rank in range(ranks)]
    for w in range(max(map(len, waves))):
        for rank in range(ranks):
            for request in waves[rank][w] if w < len(waves[rank]) else ():
                runner.add(rank, request)
        runner.run()
    for rank, rank_runner in enumerate(runner.ranks):
        stats = rank_runner.stats
        assert stats.finished == sum(map(len, DP_WAVES[rank])), rank
        assert stats.prefix_hit_tokens > 0, rank
        STATS[(name, f"data-parallel rank {rank}", "traced" if enable_trace else "eager")] = dict(
            groups=len(groups), buffers=len({*index.values()}), **vars(stats)
        )
    assert runner.all_rank_calls > 0 and runner.all_rank_calls < runner.calls  # calls of both ranks, and of one
    assert runner.shared_id_steps > 0  # both ranks wrote block ids of the same number in one call
    facade.cleanup()


def test_the_core_forms_the_groups_vllm_forms():
    """``prefill_core.vllm_layer_groups`` against vLLM's own ``get_kv_cache_groups`` for every architecture."""
    for name, types in ARCHITECTURES.items():
        _, kv_config = vllm_side.vllm_setup(
            name, project_model(name).spec, num_blocks=16, token_budget=32, max_num_seqs=SEQS
        )
        assert vllm_layer_groups(types) == vllm_side.layer_groups(kv_config), name
