"""Lane groups of tiny CPU runtimes for the lane-group tests, and the calls and pool snapshots they compare."""

from __future__ import annotations

import attrs
import torch

from prefill_core import PageTableLayout, route_to_lanes
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.lanes.group import LaneGroup
from prefill_shell.testing.faults import FaultInjectingBackend, FaultInjectingModel
from prefill_shell.testing.small import SMALL_BLOCK, SMALL_POLICY
from tests.helpers import build_runtime, randomize_pool

BLOCK, POOL, VOCAB = SMALL_BLOCK, 48, 256
LAYOUT = PageTableLayout(BLOCK, 8, POOL)
PER_LANE = SMALL_POLICY.lane_size


def lane_runtime(model, lane: int, *, lane_size: int = PER_LANE, pool: int = POOL, plan=None) -> PrefillRuntime:
    """A runtime over its own pool filled with noise seeded by ``lane`` (stray writes show); faulted by ``plan``."""
    kv = model.new_kv_cache(pool, BLOCK)
    randomize_pool(kv, seed=1000 + lane)
    backend, body = TorchBackend(), model
    if plan is not None:
        backend, body = FaultInjectingBackend(backend, plan), FaultInjectingModel(model, plan)
    policy = attrs.evolve(SMALL_POLICY, lane_size=lane_size)
    layout = PageTableLayout(BLOCK, LAYOUT.max_num_blocks_per_seq, pool)
    return build_runtime(body, policy=policy, backend=backend, layout=layout, kv=kv, seed=lane)


def make_group(model, num_lanes: int, *, threaded: bool = False, plans=None) -> LaneGroup:
    """``num_lanes`` lanes of ``PER_LANE`` slots, lane ``i`` faulted by ``plans[i]`` when given."""
    plans = plans or {}
    lanes = [PrefillExecutor(lane_runtime(model, i, plan=plans.get(i))) for i in range(num_lanes)]
    return LaneGroup(lanes, threaded=threaded)


@attrs.frozen
class GroupCall:
    """A lane-group call: caller tensors plus the routing and blocks each row writes in its lane's pool."""

    tokens: torch.Tensor
    table: torch.Tensor
    lengths: list
    cached: list
    slots: tuple | None
    sampling: list
    routes: tuple
    written: dict  # caller row -> blocks it writes (in its own lane's pool)

    def kwargs(self) -> dict:
        return dict(
            tokens=self.tokens,
            page_table=self.table,
            prompt_lengths=self.lengths,
            cached_lengths=self.cached,
            slots=None if self.slots is None else list(self.slots),
            sampling=self.sampling,
        )

    def lane_kwargs(self, route) -> dict:
        """The rows of one lane as a call on that lane's own runtime (lane slots)."""
        rows = list(route.source_rows)
        return dict(
            tokens=self.tokens[rows],
            page_table=self.table[rows],
            prompt_lengths=[self.lengths[r] for r in rows],
            cached_lengths=[self.cached[r] for r in rows],
            slots=list(route.slots),
            sampling=[self.sampling[r] for r in rows],
        )


def group_call(rows, slots, num_lanes: int, seed: int = 0) -> GroupCall:
    """Tokens and a page table for ``rows``; each lane hands out its own blocks from 1 (ids repeat across lanes)."""
    routes = route_to_lanes(slots, len(rows), PER_LANE, num_lanes)
    gen = torch.Generator().manual_seed(seed)
    width = max(length for length, _, _ in rows)
    tokens = torch.randint(1, VOCAB, (len(rows), width), generator=gen)
    table = torch.full((len(rows), LAYOUT.max_num_blocks_per_seq), -1, dtype=torch.int32)
    written = {}
    for route in routes:
        next_block = 1
        for row in route.source_rows:
            length, cached, _ = rows[row]
            need = -(-length // BLOCK)
            table[row, :need] = torch.arange(next_block, next_block + need, dtype=torch.int32)
            written[row] = set(range(next_block + cached // BLOCK, next_block + need))
            next_block += need
    return GroupCall(
        tokens,
        table,
        [r[0] for r in rows],
        [r[1] for r in rows],
        slots,
        [r[2] for r in rows],
        routes,
        written,
    )


def pool_of(runtime: PrefillRuntime) -> list[torch.Tensor]:
    """A copy of every layer's K and V pool of ``runtime`` (``[blocks + sink, H_kv, bs, D]`` each)."""
    kv = runtime.config.kv
    return [t.clone() for t in kv.keys + kv.values]


def changed_blocks(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    """Block ids whose bytes differ in any layer's K or V (the sink block, absorbing -1 writes, excluded)."""
    changed = set()
    for old, new in zip(before, after):
        diff = (old != new).flatten(1).any(1)
        changed |= set(torch.nonzero(diff[:-1]).flatten().tolist())
    return changed


def same_result(got, want, atol: float = 0.0) -> bool:
    """Token, log-probs and logits equal (within ``atol`` for floats)."""
    if got.token != want.token or [t for t, _ in got.top_logprobs] != [t for t, _ in want.top_logprobs]:
        return False
    if (got.logprob is None) != (want.logprob is None) or (got.logits is None) != (want.logits is None):
        return False
    if got.logprob is not None and abs(got.logprob - want.logprob) > atol:
        return False
    if any(abs(a - b) > atol for (_, a), (_, b) in zip(got.top_logprobs, want.top_logprobs)):
        return False
    return got.logits is None or bool((got.logits - want.logits).abs().max() <= atol)
