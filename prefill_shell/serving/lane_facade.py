"""``LaneGroupFacade``: the serving facade over a ``LaneGroup``, vLLM's data-parallel ranks as lanes.

Everything the plugin sees is ``facade.PluginFacade``'s; what is
lane-shaped (one pool per lane, the ``kv_cache`` check, warming and
preflighting every lane) lives in ``LaneGroupLanes``, as in tt-metal's
``LaneGroupExecutor``. How ranks map to lanes and what the plugin passes:
docs/serving.md ("Data parallel") and docs/lanes.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prefill_core import PrefillPolicy
from prefill_core.values.errors import KVCacheMismatchError, PrefillConfigError, PrefillStateError
from prefill_shell.backends.base import Backend
from prefill_shell.device.model import PrefillModel, model_difference
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.lanes.group import LaneGroup
from prefill_shell.serving.facade import PluginFacade

__all__ = ["LaneGroupFacade", "LaneGroupLanes"]


def _lane_pairs(lanes: Any) -> tuple:
    """The lanes as ``(model, backend)`` pairs, at least one; anything else is a ``PrefillConfigError``."""
    rule = "must be an iterable of (model, backend) pairs, one per lane, at least one"
    try:
        pairs = tuple(lanes)
    except TypeError:
        raise PrefillConfigError(f"lane group facade: lanes={type(lanes).__name__} is invalid: {rule}") from None
    if not pairs:
        raise PrefillConfigError("lane group facade: needs at least one (model, backend) lane")
    for lane, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not hasattr(pair[0], "spec"):
            raise PrefillConfigError(f"lane group facade: lanes[{lane}]={type(pair).__name__} is invalid: {rule}")
    return tuple(tuple(pair) for pair in pairs)


class LaneGroupLanes:
    """The lanes of a ``LaneGroupFacade``: one executor and one pool per ``(model, backend)``, in a ``LaneGroup``."""

    def __init__(self, lane_models: tuple, per_lane_batch: int, threaded: bool, seed: int):
        self.lane_models = lane_models
        self.model, self.backend = lane_models[0]
        self.pool_rows = per_lane_batch  # a pool serves one lane's slots
        self.threaded = threaded
        self._seed = seed
        self.group: LaneGroup | None = None
        # pool_factory(model, num_blocks, block_size): how a KV-group facade builds each lane's pool.
        self.pool_factory: Callable[[Any, int, int], Any] | None = None

    def regroup(self, regrouped: Callable[[Any], Any]) -> None:
        """Replaces every lane's model by ``regrouped(model)`` (a KV-group facade at allocation)."""
        self.lane_models = tuple((regrouped(model), backend) for model, backend in self.lane_models)
        self.model = self.lane_models[0][0]

    @property
    def built(self) -> bool:
        return self.group is not None

    def executors(self) -> list[PrefillExecutor]:
        if self.group is None:
            raise PrefillStateError("call allocate_kv_cache before any prefill: no KV pools are allocated yet")
        return list(self.group.lanes)

    def target(self) -> LaneGroup:
        """What runs a normalised call: the group routes rows to lanes by slot."""
        self.executors()
        return self.group

    def build(self, num_blocks: int, block_size: int, lane_executor) -> list:
        """One pool (each of vLLM's shape) and executor per lane; returns the pools in lane order."""
        executors: list[PrefillExecutor] = []
        pools = []
        try:
            for lane, (model, backend) in enumerate(self.lane_models):
                make = self.pool_factory
                pool = (
                    model.new_kv_cache(num_blocks, block_size) if make is None else make(model, num_blocks, block_size)
                )
                executors.append(lane_executor(model, backend, pool, num_blocks, block_size, self._seed + lane))
                pools.append(pool)
            self.group = LaneGroup(executors, threaded=self.threaded)
        except BaseException:
            for executor in executors:
                executor.close()
            raise
        return pools

    def release(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None

    def check_kv(self, kv_cache: Any) -> None:
        if kv_cache is None:
            return
        pools = [executor.runtime.config.kv for executor in self.executors()]
        rule = f"a lane group takes one pool per lane ({len(pools)}), in lane order, as allocate_kv_cache returned"
        if not isinstance(kv_cache, (list, tuple)):
            raise KVCacheMismatchError(f"kv_cache={type(kv_cache).__name__} is invalid: {rule}", field="kv_cache")
        if len(kv_cache) != len(pools):
            raise KVCacheMismatchError(f"kv_cache holds {len(kv_cache)} entries: {rule}", field="kv_cache")
        for lane, given in enumerate(kv_cache):
            if given is pools[lane]:
                continue
            owner = next((i for i, pool in enumerate(pools) if pool is given), None)
            what = "a pool of no lane" if owner is None else f"lane {owner}'s pool"
            raise KVCacheMismatchError(f"kv_cache[{lane}] is {what}: {rule}", field="kv_cache")


class LaneGroupFacade(PluginFacade):
    """The plugin's facade over one lane per ``(model, backend)`` pair, ``policy.lane_size`` slots each.

    Each lane's pool comes from its own model's ``new_kv_cache``; lane ``i``'s
    runtime is seeded ``seed + i``. ``threaded`` is ``LaneGroup``'s. Every
    lane's model must match lane 0's (``device.model.model_difference``).
    ``pooler`` and ``score`` are ``ServingFacade``'s: every lane pools its own
    rows, with the one head.
    """

    def __init__(
        self,
        lanes: Sequence[tuple[PrefillModel, Backend]],
        *,
        max_seq_len: int,
        policy: PrefillPolicy | None = None,
        kv_dtype=None,
        prefill_traces: bool = True,
        warmup_lengths=None,
        threaded: bool = False,
        seed: int = 0,
        pooler=None,
        score=None,
    ):
        lane_models = _lane_pairs(lanes)
        model = lane_models[0][0]
        for lane, (other, _) in enumerate(lane_models):
            difference = model_difference(model, other)
            if difference is not None:
                raise PrefillConfigError(f"lane group facade: lane {lane}'s model differs from lane 0's ({difference})")
        policy = PrefillPolicy() if policy is None else policy
        if not isinstance(policy, PrefillPolicy):
            raise PrefillConfigError(f"lane group facade: policy={type(policy).__name__} is invalid: a PrefillPolicy")
        self.per_lane_batch = policy.lane_size
        super().__init__(
            LaneGroupLanes(lane_models, self.per_lane_batch, bool(threaded), seed),
            max_seq_len=max_seq_len,
            max_batch_size=len(lane_models) * self.per_lane_batch,
            policy=policy,
            kv_dtype=kv_dtype,
            prefill_traces=prefill_traces,
            warmup_lengths=warmup_lengths,
            seed=seed,
            pooler=pooler,
            score=score,
        )

    @property
    def num_lanes(self) -> int:
        return len(self.lanes.lane_models)

    @property
    def lane_models(self) -> tuple:
        return self.lanes.lane_models

    @property
    def group(self) -> LaneGroup | None:
        """The lane group (None before ``allocate_kv_cache`` and after ``cleanup``)."""
        return self.lanes.group

    @property
    def runtimes(self) -> tuple[PrefillRuntime, ...]:
        """The lanes' runtimes, in lane order."""
        return tuple(executor.runtime for executor in self.lanes.executors())
