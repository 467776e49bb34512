"""``LaneGroup``: data-parallel lanes, one ``PrefillExecutor`` each, presented as one prefill target.

A call routes its rows by slot (``prefill_core.route_to_lanes``), prepares
and preflights every lane before any runs, dispatches them
(``lanes.dispatch``) and returns one result per caller row in caller order.
Routing, dispatch, failures and meshes: docs/lanes.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from prefill_core import ExecutionMode, SamplingParams, WarmupManifest, route_to_lanes
from prefill_core.values.errors import (
    CleanupError,
    EmptyBatchError,
    PrefillConfigError,
    PrefillInputError,
    TraceCoverageError,
)
from prefill_core.values.sampling import refuse_per_row_extras
from prefill_shell.device.model import model_difference
from prefill_shell.device.notes import add_note
from prefill_shell.engine.call import PrefillCall, PrefillEntry
from prefill_shell.engine.call_guard import CallGuard, exclusive
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.progress import ProgressCallback
from prefill_shell.engine.result import BatchResult, PrefillResult
from prefill_shell.engine.steps.pooled_states import with_pooled
from prefill_shell.lanes.dispatch import LaneCall, run_in_turn, run_on_threads

__all__ = ["LaneGroup"]


def _same_for_every_lane(executors: Sequence[PrefillExecutor]) -> int:
    """The lanes' common ``lane_size``; refuses lanes of different models (spec, dtype) and shared runtimes,
    backends or KV pools."""
    first = executors[0].runtime.config.model
    for lane, executor in enumerate(executors[1:], start=1):
        difference = model_difference(first, executor.runtime.config.model)
        if difference is not None:
            raise PrefillConfigError(f"lane group: lane {lane}'s model differs from lane 0's ({difference})")
    sizes = [e.runtime.config.policy.lane_size for e in executors]
    if len(set(sizes)) != 1:
        raise PrefillConfigError(f"lane group: every lane needs the same policy.lane_size; lanes have {sizes}")
    for what in ("runtime", "backend", "KV pool"):
        owners: dict[int, int] = {}
        for lane, executor in enumerate(executors):
            runtime = executor.runtime
            thing = {"runtime": runtime, "backend": runtime.backend, "KV pool": runtime.config.kv}[what]
            if id(thing) in owners:
                raise PrefillConfigError(f"lane group: lanes {owners[id(thing)]} and {lane} share one {what}")
            owners[id(thing)] = lane
    return sizes[0]


def _per_row(value: Any, field: str, num_rows: int) -> list | None:
    """A per-row argument as a list of ``num_rows`` entries (``None`` stays ``None``).

    A 1-D tensor or a sequence; anything else (a 0-d tensor, a number) is a
    ``PrefillInputError`` naming ``field``. The lanes judge the entries.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.layout is torch.strided and not value.is_meta:
        items = value.tolist()
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes, torch.Tensor)):
        items = list(value)
    else:
        shown = (
            f"<tensor {tuple(value.shape)} on {value.device}>"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        rule = f"must be a sequence or a dense 1-D tensor with one entry per row ({num_rows})"
        msg = f"{field}={shown} is invalid: {rule}"
        raise PrefillInputError(msg, field=field)
    if len(items) != num_rows:
        raise PrefillInputError(f"{field} has {len(items)} entries: must have one per row ({num_rows})", field=field)
    return items


def _pick(items: list | None, rows: tuple[int, ...]) -> list | None:
    return None if items is None else [items[row] for row in rows]


def _in_caller_rows(error: PrefillInputError, lane: int, rows: tuple[int, ...]) -> PrefillInputError:
    """A lane's input error restated for the caller's row (the lane's row index is local to the lane)."""
    if error.row is None:
        return type(error)(f"lane {lane}: {error}", field=error.field)
    text, local = str(error), f"row {error.row}: "
    rest = text[len(local) :] if text.startswith(local) else text
    caller = rows[error.row]
    return type(error)(f"row {caller}: (lane {lane}, its row {error.row}) {rest}", row=caller, field=error.field)


class LaneGroup(PrefillEntry):
    """Data-parallel lanes of ``per_lane_batch`` slots each, routed by slot (see module doc).

    ``threaded=False`` (the default) runs the lanes in turn from the calling
    thread, every lane's work issued before the first readback: what an
    asynchronous device needs, and on this project's shared 2-core CPU as
    fast as lanes on threads of their own (``benchmarks/lanes.py``).
    ``threaded=True`` runs each lane on a thread of its own, for a CPU host
    where that measures faster. One call at a time, like each lane's runtime.
    """

    def __init__(self, executors: Sequence[PrefillExecutor], *, threaded: bool = False):
        try:
            self.lanes = tuple(executors)
        except TypeError:
            raise PrefillConfigError(f"lane group: executors={type(executors).__name__} is not a sequence") from None
        if not self.lanes:
            raise PrefillConfigError("lane group: needs at least one lane")
        for lane, executor in enumerate(self.lanes):
            if not isinstance(executor, PrefillExecutor):
                raise PrefillConfigError(
                    f"lane group: lane {lane} is a {type(executor).__name__}, not a PrefillExecutor"
                )
        self.per_lane_batch = _same_for_every_lane(self.lanes)
        self.threaded = bool(threaded)
        # One call at a time for the whole group, as for each lane's runtime: a second thread's entry is refused
        # before any lane prepares, runs or closes (a lane held only by its own runtime could be half served).
        self._guard = CallGuard("LaneGroup")

    @property
    def num_lanes(self) -> int:
        return len(self.lanes)

    @property
    def max_batch_size(self) -> int:
        """Slots of the whole group: ``num_lanes * per_lane_batch``."""
        return self.num_lanes * self.per_lane_batch

    @exclusive
    def warm_up(
        self, manifest: WarmupManifest | Sequence[WarmupManifest], on_progress: ProgressCallback | None = None
    ) -> None:
        """Warms every lane, lane by lane: one manifest for all, or one per lane."""
        manifests = [manifest] * self.num_lanes if isinstance(manifest, WarmupManifest) else list(manifest)
        if len(manifests) != self.num_lanes:
            raise PrefillConfigError(f"lane group: {len(manifests)} manifests for {self.num_lanes} lanes")
        for executor, lane_manifest in zip(self.lanes, manifests):
            executor.warm_up(lane_manifest, on_progress)

    @exclusive
    def run(self, call: PrefillCall) -> list[PrefillResult] | BatchResult:
        """Routes rows to lanes by group slot, runs every lane's rows, returns results in caller row order.

        ``PrefillEntry.prefill`` builds the call. ``batched=True``: as
        caller-ordered tensors (``BatchResult``); a row asking top or prompt
        log-probs raises ``InvalidSamplingError`` before any lane runs. The
        call's mode plans and runs every lane's share, as
        ``PrefillExecutor.run`` does; a model with KV groups takes one page
        table or its group tables on every lane alike.
        """
        sampling = call.sampling
        if call.batched:
            if isinstance(sampling, (list, tuple, SamplingParams)):
                listed = [sampling] if isinstance(sampling, SamplingParams) else sampling
                refuse_per_row_extras(range(len(listed)), listed)
            return BatchResult.from_results(self.run(attrs.evolve(call, batched=False)))
        num_rows = call.num_rows
        if not num_rows:
            raise EmptyBatchError("lane group: tokens holds no rows: a batch needs at least one row", field="rows")
        one = sampling is None or isinstance(sampling, SamplingParams)  # one value for every row, as a runtime takes
        per_row = attrs.evolve(
            call,
            prompt_lengths=_per_row(call.prompt_lengths, "prompt_lengths", num_rows),
            cached_lengths=_per_row(call.cached_lengths, "cached_lengths", num_rows),
            sampling=[sampling] * num_rows if one else _per_row(sampling, "sampling", num_rows),
        )
        routes = route_to_lanes(_per_row(call.slots, "slots", num_rows), num_rows, self.per_lane_batch, self.num_lanes)
        batches = []
        for route in routes:
            runtime = self.lanes[route.lane].runtime
            rows = route.source_rows
            try:
                batch = runtime.prepare_call(per_row.for_rows(rows, _pick, route.slots))
            except PrefillInputError as error:
                raise _in_caller_rows(error, route.lane, rows) from None
            batches.append(batch)
        calls = self._preflight(routes, batches, call.mode)
        by_lane = (run_on_threads if self.threaded else run_in_turn)(calls)
        merged: dict[int, PrefillResult] = {}
        for lane_call in calls:
            for local, result in enumerate(with_pooled(lane_call.batch, by_lane[lane_call.lane])):
                merged[lane_call.source_rows[local]] = result._replace(row=lane_call.source_rows[local])
        return [merged[row] for row in range(num_rows)]

    def _preflight(self, routes, batches, mode: ExecutionMode) -> list[LaneCall]:
        """Every lane's stream, each preflighted (traced coverage, mode) before any lane runs."""
        calls: list[LaneCall] = []
        try:
            for route, batch in zip(routes, batches):
                executor = self.lanes[route.lane]
                try:
                    stream = executor.invocations(batch, mode)
                except TraceCoverageError as error:
                    msg = f"lane {route.lane} (caller rows {list(route.source_rows)}): {error}; no lane ran"
                    raise TraceCoverageError(msg) from error
                calls.append(LaneCall(route.lane, route.source_rows, executor.runtime, batch, stream))
        except BaseException:
            for call in calls:
                call.stream.close()  # never started: closing runs nothing
            raise
        return calls

    @exclusive
    def cleanup(self) -> None:
        """Retries every lane's orphans; ``CleanupError`` names the lanes that still hold some."""
        self._each_lane("cleanup", lambda executor: executor.runtime.cleanup())

    @exclusive
    def close(self) -> None:
        """Closes every lane (traces, workspaces, orphans), even when one fails; refuses further calls."""
        self._each_lane("close", lambda executor: executor.close())

    def _each_lane(self, what: str, action) -> None:
        failures: list[tuple[int, BaseException]] = []
        for lane, executor in enumerate(self.lanes):
            try:
                action(executor)
            except Exception as error:
                failures.append((lane, error))
        if not failures:
            return
        orphans = [o for _, e in failures for o in getattr(e, "orphans", ())]
        listed = "; ".join(f"lane {lane}: {error}" for lane, error in failures)
        error = CleanupError(f"lane group {what}: {listed}", orphans)
        for lane, cause in failures:
            add_note(error, f"lane {lane}: {cause!r}")
        raise error
