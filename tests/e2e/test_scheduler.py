"""A vLLM-like scheduler drives ``prefill_forward`` step after step: chunk ends anywhere, prefix hits, preemptions.

Each request's final-chunk logits equal a one-shot prefill of its whole
prompt and transformers (1e-4), eager and traced; no KV byte outside a
step's own blocks changes; seeded sampled tokens are equal eager and traced.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_shell.backends import TorchBackend
from prefill_shell.serving.facade import ServingFacade
from tests.e2e.vllm_like_scheduler import BlockPool, Scheduler, SimRequest, drive

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many small steps: see the fixture

BLOCK = 16
NUM_BLOCKS = {256: 64, 2048: 176}
"""Pool size per budget: at 2048 a step must be able to hold more than the budget, so the budget cuts chunks."""
MAX_SEQS = 16
DECODE_STEPS = 8
POLICY = PrefillPolicy(max_chunk_length=256, chunk_quantum=128, length_ladder=(128, 256), waves=(1, 2, 4, 8))


def make_requests(kit, count: int = 44, seed: int = 0) -> list[SimRequest]:
    """Prompts of 5-500 tokens in groups of twelve arriving together every other step, most groups behind one
    shared system prompt (so a later request of a step can hit blocks an earlier one is writing)."""
    rng = random.Random(seed)
    systems = [kit.make_tokens(n, seed=900 + i) for i, n in enumerate((40, 75, 100))]
    requests = []
    for i in range(count):
        group = i // 12
        head = None if group % 4 == 3 else systems[group % 3]
        tail = kit.make_tokens(rng.choice((rng.randint(5, 160), rng.randint(160, 400))), seed=1000 + i)
        prompt = tail if head is None else torch.cat([head, tail])
        requests.append(SimRequest(i, prompt, arrival=2 * group, seed=rng.randrange(2**31)))
    return requests


def serving_facade(model, kit, *, traced: bool, sampled: bool, budget: int) -> ServingFacade:
    facade = ServingFacade(model, TorchBackend(), max_seq_len=512, max_batch_size=MAX_SEQS, policy=POLICY)
    spec = model.spec
    kv = facade.allocate_kv_cache(
        (NUM_BLOCKS[budget], spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers
    )
    kit.randomize_pool(kv, seed=11)  # stray writes show as changed bytes
    if traced:
        facade.warmup_model_prefill(kv_cache=kv, can_sample_on_device=sampled, enable_trace=True)
    return facade


def _plugin_sampling(rows: list[SimRequest]):
    """Per-row lists as the plugin sends them: device top-k rows, and whole-vocabulary (host) rows."""
    k = [20 if r.id % 3 else -1 for r in rows]
    return SimpleNamespace(
        temperature=[0.8] * len(rows),
        top_k=k,
        top_p=[0.9] * len(rows),
        seed=[r.seed for r in rows],
        num_logprobs=[0] * len(rows),
    )


def run(facade: ServingFacade, requests: list[SimRequest], *, budget: int, traced: bool, sampled: bool) -> dict:
    """Drives every request to its end (``drive`` checks each step's KV writes); the scheduler's counts."""
    pool = BlockPool(NUM_BLOCKS[budget], BLOCK)
    scheduler = Scheduler(requests, pool, budget=budget, max_num_seqs=MAX_SEQS, decode_steps=DECODE_STEPS)
    drive(facade, scheduler, traced=traced, sampling=_plugin_sampling if sampled else None, seed=budget)
    return scheduler.stats


@pytest.fixture(scope="module")
def one_shot(tiny_model, kit):
    """Each request's whole prompt prefilled at once on a separate runtime: its last-token logits."""
    prompts = [r.tokens for r in make_requests(kit)]
    runtime = kit.build_runtime(tiny_model, num_blocks=1200, block_size=BLOCK, policy=POLICY)
    table = kit.page_table(kit.assign_blocks([len(p) for p in prompts], BLOCK, 1200, seed=1))
    results = runtime.prefill(kit.token_matrix(prompts), table, [len(p) for p in prompts])
    return [r.logits for r in results]


@pytest.mark.parametrize("budget", [256, 2048])
def test_final_chunk_logits_equal_a_one_shot_prefill_and_transformers(tiny_model, kit, oracle, one_shot, budget):
    """44 requests at this budget, eager and traced: every final-chunk logit within 1e-4 of both oracles."""
    for traced in (False, True):
        requests = make_requests(kit)
        facade = serving_facade(tiny_model, kit, traced=traced, sampled=False, budget=budget)
        stats = run(facade, requests, budget=budget, traced=traced, sampled=False)
        facade.cleanup()
        for request, expected in zip(requests, one_shot):
            assert request.results, request.id
            for logits in request.results:  # a preempted request completes its prefill again
                assert kit.max_abs_diff(logits, expected) <= kit.TOL, (traced, request.id)
                assert kit.max_abs_diff(logits, oracle.logits(request.tokens)) <= kit.TOL, (traced, request.id)
        # The run covered what it is meant to: starts inside blocks, prefix hits (some within one step), preemption.
        assert stats["unaligned_starts"] and stats["prefix_hit_blocks"] and stats["same_step_hits"], stats
        assert stats["preemptions"], stats


def test_seeded_sampled_tokens_equal_eager_and_traced(tiny_model, kit):
    """Per-row seeds through device top-k and host rows: tokens and log-probs equal eager and traced."""
    outcomes = []
    for traced in (False, True):
        requests = make_requests(kit)
        facade = serving_facade(tiny_model, kit, traced=traced, sampled=True, budget=256)
        run(facade, requests, budget=256, traced=traced, sampled=True)
        facade.cleanup()
        outcomes.append([r.results for r in requests])
    assert outcomes[0] == outcomes[1]
