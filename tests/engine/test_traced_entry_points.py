"""Every traced entry point plans the padded waves a trace serves, on a lane whose policy packs eager calls.

Regression (issue 33): the packed-or-padded choice was made in five places.
On a packed policy, ``PrefillRuntime.prefill(traced=True)`` and
``LaneGroup.prefill(mode="traced")`` planned packed steps and raised
``TraceCoverageError: ... not trace-eligible`` after a warm-up of the padded
plan, a ``LaneGroupFacade`` failed after ``warmup_model_prefill(enable_trace=
True)``, and a lane group's ``"auto"`` never replayed. Now one decision
(``prefill_core.values.execution.plans_packed``) plans every entry point, and
``"auto"`` replays where traces exist.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import ExecutionMode, PageTableLayout, PrefillPolicy, RequestKind, SamplingPath, manifest_for
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.lanes.group import LaneGroup
from prefill_shell.scoring.scorer import Scorer
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.lane_facade import LaneGroupFacade
from tests.helpers import build_runtime

BLOCK, POOL, MAX_SEQ, LANE = 16, 64, 128, 4
POLICY = PrefillPolicy(
    max_chunk_length=128, chunk_quantum=128, length_ladder=(128,), waves=(1, 2, 4), lane_size=LANE, packed_steps=True
)
LAYOUT = PageTableLayout(BLOCK, MAX_SEQ // BLOCK, POOL)
LENGTHS = [100, 37, 128]


def _call(seed: int = 0) -> dict:
    tokens = torch.randint(1, 256, (len(LENGTHS), MAX_SEQ), generator=torch.Generator().manual_seed(seed))
    need = [-(-n // BLOCK) for n in LENGTHS]
    table = torch.full((len(LENGTHS), MAX_SEQ // BLOCK), -1, dtype=torch.int32)
    start = 1
    for row, n in enumerate(need):
        table[row, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    return dict(tokens=tokens, page_table=table, prompt_lengths=LENGTHS)


def _replays(runtimes) -> int:
    return sum(trace.replays for runtime in runtimes for trace in runtime.captured_traces())


def _runtime(model, seed: int = 0):
    return build_runtime(model, policy=POLICY, layout=LAYOUT, seed=seed)


def _warmed(model, seed: int = 0) -> PrefillExecutor:
    runtime = _runtime(model, seed)
    assert runtime.config.packed_steps, "the lane must pack eager calls, or this test proves nothing"
    executor = PrefillExecutor(runtime)
    executor.warm_up(manifest_for(POLICY, LAYOUT, [SamplingPath.LOGITS]))
    return executor


def _logits(results) -> torch.Tensor:
    return torch.stack([r.logits for r in results])


@pytest.fixture
def eager(tiny_model):
    """The call's logits run eagerly (packed steps) on a fresh lane."""
    runtime = _runtime(tiny_model)
    batch = runtime.prepare(**_call(), mode="eager")
    assert {p.request.kind for p in batch.requests} == {RequestKind.PACKED}
    return _logits(runtime.assemble(runtime.invocations(batch, mode="eager"), batch.num_rows))


@pytest.mark.parametrize("mode", ["traced", "auto"])
def test_runtime_prefill_replays_after_a_warm_up(tiny_model, eager, mode):
    executor = _warmed(tiny_model)
    runtime = executor.runtime
    before = _replays([runtime])
    results = runtime.prefill(**_call(), mode=mode)
    assert _replays([runtime]) > before
    assert (_logits(results) - eager).abs().max().item() <= 1e-4
    executor.close()


@pytest.mark.parametrize("mode", ["traced", "auto"])
def test_executor_prefill_replays_after_a_warm_up(tiny_model, eager, mode):
    executor = _warmed(tiny_model)
    before = _replays([executor.runtime])
    results = executor.prefill(**_call(), mode=mode)
    assert _replays([executor.runtime]) > before
    assert (_logits(results) - eager).abs().max().item() <= 1e-4
    executor.close()


@pytest.mark.parametrize("mode", ["traced", "auto"])
def test_lane_group_prefill_replays_on_every_lane(tiny_model, eager, mode):
    group = LaneGroup([_warmed(tiny_model, seed) for seed in (0, 1)])
    runtimes = [lane.runtime for lane in group.lanes]
    before = _replays(runtimes)
    call = _call()
    results = group.prefill(**call, slots=[0, LANE, 1], mode=mode)  # rows 0 and 2 on lane 0, row 1 on lane 1
    assert all(sum(t.replays for t in rt.captured_traces()) for rt in runtimes), "a lane ran eagerly"
    assert _replays(runtimes) > before
    assert (_logits(results) - eager).abs().max().item() <= 1e-4
    group.close()


def _shape(model):
    spec = model.spec
    return (POOL, spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers


@pytest.mark.parametrize("kind", ["single", "lanes"])
def test_facades_replay_after_the_plugins_traced_warm_up(tiny_model, eager, kind):
    if kind == "single":
        facade = ServingFacade(tiny_model, TorchBackend(), max_seq_len=MAX_SEQ, max_batch_size=LANE, policy=POLICY)
    else:
        facade = LaneGroupFacade(
            [(tiny_model, TorchBackend()), (tiny_model, TorchBackend())], max_seq_len=MAX_SEQ, policy=POLICY
        )
    kv = facade.allocate_kv_cache(*_shape(tiny_model))
    facade.warmup_model_prefill(kv_cache=kv, can_sample_on_device=False, enable_trace=True)
    runtimes = [facade.runtime] if kind == "single" else list(facade.runtimes)
    before = _replays(runtimes)
    call = _call()
    logits = facade.prefill_forward(
        call["tokens"],
        call["page_table"],
        prompt_lens=torch.tensor(LENGTHS),
        start_pos=torch.zeros(len(LENGTHS), dtype=torch.int64),
        empty_slots=[0, 1, 2] if kind == "single" else [0, LANE, 1],
        enable_trace=True,
        kv_cache=kv,
    )
    assert _replays(runtimes) > before
    assert (logits[:, 0] - eager).abs().max().item() <= 1e-4
    facade.cleanup()


def test_scorer_modes_plan_alike_and_score_alike(tiny_model):
    """A traced scorer replays (padded waves), an eager one packs; their scores agree."""
    pairs = [([5, 6, 7] * 10, [8, 9]), ([5, 6, 7] * 10, [10]), ([11] * 40, [12, 13, 14])]
    scores = {}
    for mode in ExecutionMode:
        scorer = Scorer(_runtime(tiny_model), mode=mode)
        scores[mode] = [s.logprob for s in scorer.score(pairs)]
        replayed = _replays([scorer.runtime])
        assert (replayed > 0) == (mode is ExecutionMode.TRACED), mode
        scorer.runtime.close()
    for mode in ExecutionMode:
        assert max(abs(a - b) for a, b in zip(scores[mode], scores[ExecutionMode.EAGER])) <= 1e-4


def test_lm_eval_model_traced_scores_as_eager(tmp_path):
    """The lm-eval model's traced=True plans what its traces serve, and scores as traced=False does."""
    pytest.importorskip("lm_eval")
    from prefill_shell.scoring.lm_eval_model import PrefillRuntimeLM

    pairs = [([1, 2, 3, 4] * 8, [5, 6]), ([1, 2, 3, 4] * 8, [7])]
    got = {}
    for traced in (False, True):
        lm = PrefillRuntimeLM(model="random:tiny", max_length=64, block_size=16, max_chunk=64, traced=traced)
        assert lm.scorer.runtime.config.packed_steps
        got[traced] = [s.logprob for s in lm.scorer.score(pairs)]
        assert (_replays([lm.scorer.runtime]) > 0) is traced
    assert max(abs(a - b) for a, b in zip(got[False], got[True])) <= 1e-4


def test_packed_policy_is_what_the_scorer_entry_points_share():
    from prefill_shell.scoring.setup import scoring_policy

    assert attrs.evolve(scoring_policy(16, 64), packed_steps=False) == PrefillPolicy.fine_rungs(16, max_chunk_length=64)
    assert scoring_policy(16, 64).packed_steps
