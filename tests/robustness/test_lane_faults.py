"""Faults across lanes: each device call of lane 1 failed once leaves lane 0 whole and the group usable."""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams, WarmupManifest
from prefill_shell.reference import random_llama
from prefill_shell.testing.faults import FaultPlan, InjectedFault
from prefill_shell.testing.sweep import single_threaded
from tests.lane_kit import PER_LANE, changed_blocks, group_call, make_group, pool_of

ROWS = [
    (40, 0, None),  # lane 0
    (100, 0, SamplingParams.greedy(num_logprobs=2)),  # lane 1: chunked (64-token chunks)
    (70, 0, SamplingParams(top_k=3, seed=7)),  # lane 0
    (30, 0, SamplingParams(top_k=0, temperature=0.8, seed=9)),  # lane 1: host-sampled
]
SLOTS = (2, PER_LANE + 1, 0, PER_LANE)


@pytest.fixture(scope="module")
def tiny_model():
    return random_llama(0, "tiny")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op torch thread: a tiny model's ops are too small to split, and on shared cores threads contend."""
    with single_threaded():
        yield


def _group(model, plan, threaded: bool, mode: str):
    """A 2-lane group whose lane 1 is faulted by ``plan``; for ``traced``, both lanes warmed before the plan counts."""
    group = make_group(model, 2, plans={1: plan}, threaded=threaded)
    if mode == "traced":
        fail_at = plan.fail_at
        plan.arm(None)  # warm-up calls are not fault points
        call = group_call(ROWS, SLOTS, 2)
        for route in call.routes:
            lane = group.lanes[route.lane]
            lane.warm_up(WarmupManifest().observe(lane.runtime.prepare(**call.lane_kwargs(route)).requests))
        plan.arm(fail_at)  # count from the call on
    return group


@pytest.fixture(scope="module")
def clean(tiny_model, request):
    """The mode, the call, its unfaulted results, each lane's pool after it, lane 1's device calls and releases."""
    call = group_call(ROWS, SLOTS, 2)
    counting = FaultPlan()
    group = _group(tiny_model, counting, False, request.param)
    results = group.prefill(**call.kwargs(), mode=request.param)
    releases = sum(entry.startswith("release:") for entry in counting.log)
    pools = [pool_of(lane.runtime) for lane in group.lanes]
    return request.param, call, results, pools, (counting.calls, releases)


def _lane0_only(call) -> dict:
    """The call cut to lane 0's rows, at the same group slots."""
    rows = list(call.routes[0].source_rows)
    return dict(
        tokens=call.tokens[rows],
        page_table=call.table[rows],
        prompt_lengths=[call.lengths[r] for r in rows],
        slots=[SLOTS[r] for r in rows],
        sampling=[call.sampling[r] for r in rows],
    )


def _each_block_is_before_or_clean(before, after, clean_pool) -> bool:
    """Every block of lane 0's pool holds its bytes from before the call or those the clean call wrote.

    The last block is the write-only sink that absorbs ``-1`` writes: it holds whatever was written last.
    """
    return all(
        bool(((a == b).flatten(1).all(1) | (a == c).flatten(1).all(1))[:-1].all())
        for b, a, c in zip(before, after, clean_pool)
    )


# Traced faults run in turn only (the default dispatch), for time.
@pytest.mark.parametrize(
    "clean, threaded",
    [("eager", True), ("eager", False), ("traced", False)],
    ids=["eager-threads", "eager-in turn", "traced-in turn"],
    indirect=["clean"],
)
@pytest.mark.parametrize("raises", [InjectedFault, KeyboardInterrupt], ids=lambda t: t.__name__)
def test_every_fault_of_lane_1_leaves_lane_0_whole_and_the_group_usable(tiny_model, clean, raises, threaded):
    """Each device call of lane 1 failed once: lane 0's KV intact, nothing leaks, lane 0 and the call re-run equal."""
    mode, call, want, clean_pools, (points, releases) = clean
    assert points >= 20 and (releases > 0 or mode == "traced")  # a replay releases nothing it made
    lane0_rows = list(call.routes[0].source_rows)
    lane0_written = set().union(*(call.written[r] for r in lane0_rows))
    failed = 0
    for fail_at in range(1, points + 1):
        plan = FaultPlan(fail_at=fail_at, raises=raises)
        group = _group(tiny_model, plan, threaded, mode)
        lane0 = group.lanes[0].runtime
        before = pool_of(lane0)
        persistent = [{h.id for h in lane.runtime.backend.ledger.live()} for lane in group.lanes]
        try:
            got = group.prefill(**call.kwargs(), mode=mode)
        except raises as error:
            assert error is plan.fired, f"point {fail_at}: the injected error reaches the caller unchanged"
            assert getattr(error, "lane", None) == 1, f"point {fail_at}: the error names lane 1"
            failed += 1
        else:  # a failed release inside the call is kept as an orphan, not raised
            assert got == want and group.lanes[1].runtime.orphans, f"point {fail_at}: {plan.log[-1]}"
        assert changed_blocks(before, pool_of(lane0)) <= lane0_written, f"point {fail_at}"
        assert _each_block_is_before_or_clean(before, pool_of(lane0), clean_pools[0]), f"point {fail_at}"
        group.cleanup()
        live = [{h.id for h in lane.runtime.backend.ledger.live()} for lane in group.lanes]
        assert live == persistent, f"point {fail_at}: only traces and workspaces outlive a call"
        again = group.prefill(**_lane0_only(call), mode=mode)
        assert again == [want[r]._replace(row=i) for i, r in enumerate(lane0_rows)], f"point {fail_at}"
        assert all(torch.equal(a[:-1], b[:-1]) for a, b in zip(pool_of(lane0), clean_pools[0]))
        if fail_at % 4 == 0:  # every fourth point (for time): the whole call served again by the same group
            assert group.prefill(**call.kwargs(), mode=mode) == want, f"point {fail_at}: served again"
        group.close()
        assert [lane.runtime.backend.ledger.live() for lane in group.lanes] == [[], []], f"point {fail_at}"
    # A failed release is kept as an orphan; an interrupt there propagates (after orphaning the rest).
    assert failed == (points if raises is KeyboardInterrupt else points - releases)
