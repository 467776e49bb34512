"""Fault sweeps: fail every device call of a run, one at a time, and measure the damage.

For a scenario (a call on a fresh runtime over a randomly filled KV pool)
``sweep`` first counts the run's fault points, then for each point N runs it
again failing call N (and the next two releases, so cleanup fails too) and
records: whether the caller saw the injected error itself, whether cleanup
failures rode along as notes, live tensors left after ``cleanup``/``close``,
KV bytes changed outside the blocks the call writes, and whether the same
runtime then served the call again with the oracle's results.

``raises`` picks what the fault point raises: ``InjectedFault`` (a
``RuntimeError``) or a ``BaseException`` such as ``KeyboardInterrupt``
(Ctrl-C), which ``except Exception`` clauses do not see. The blocks a call
writes are each row's columns ``[cached // block, ceil(length / block))``:
cached-prefix blocks are only read, so a byte changed there counts as
corruption, as anywhere else outside the written blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import attrs
import torch

from prefill_core import PageTableLayout, SamplingParams, WarmupManifest, ceil_div
from prefill_shell.engine.executor import PrefillExecutor

from ..backends import TorchBackend
from .faults import FaultInjectingBackend, FaultInjectingModel, FaultPlan, InjectedFault
from .runtime_builder import build_runtime
from .small import SMALL_BLOCK, SMALL_POLICY

__all__ = ["FAULT_TYPES", "Scenario", "SweepReport", "SCENARIOS", "sweep"]

BLOCK, POLICY, POOL = SMALL_BLOCK, SMALL_POLICY, 64


@attrs.frozen
class Scenario:
    """One call: rows' lengths, cached prefixes, sampling, and its mode (``"eager"`` or ``"traced"``)."""

    name: str
    lengths: tuple[int, ...]
    cached: tuple[int, ...]
    sampling: tuple
    mode: str = "eager"


SCENARIOS = (
    Scenario("eager wave", (20, 50, 64), (0, 0, 0), (None, None, None)),
    Scenario("eager chunked+cached", (150, 100), (0, 32), (None, None)),
    Scenario(
        "eager fully cached",
        (48, 70, 30),
        (48, 64, 0),
        (SamplingParams.greedy(num_logprobs=1), None, SamplingParams(top_k=3, seed=5)),
    ),
    Scenario(
        "eager sampled",
        (40, 60, 33),
        (0, 0, 0),
        (
            SamplingParams(top_k=5, seed=3, num_logprobs=2),
            SamplingParams.greedy(num_logprobs=3),
            SamplingParams(temperature=0.7, top_k=0, seed=9, num_logprobs=1),
        ),
    ),
    Scenario(
        "traced wave+chunked",
        (20, 50, 150),
        (0, 0, 0),
        (SamplingParams(top_k=4, seed=1), SamplingParams(top_k=4, seed=2), SamplingParams.greedy()),
        mode="traced",
    ),
    Scenario(
        "eager beyond one lane",
        (20, 40, 9, 33, 64, 17),
        (0, 16, 0, 0, 48, 0),
        (None, SamplingParams.greedy(), None, SamplingParams(top_k=3, seed=2), None, None),
    ),
    Scenario("traced cached", (100, 40), (64, 32), (None, SamplingParams.greedy()), mode="traced"),
)
FAULT_TYPES = (InjectedFault, KeyboardInterrupt)
"""What the sweeps raise at a fault point: an ``Exception`` and an interrupt."""


@attrs.frozen
class SweepReport:
    scenario: str
    raises: str
    fault_points: int
    points_swept: int
    faults_raised: int
    errors_unchanged: int
    release_faults_kept_as_orphans: int
    runs_with_cleanup_notes: int
    leaked_tensors: int
    kv_bytes_corrupted: int
    wrong_results_after_fault: int


class _Harness:
    """A runtime over a random KV pool, plus the call's inputs."""

    def __init__(self, model, scenario: Scenario, plan: FaultPlan):
        self.scenario = scenario
        self.kv = model.new_kv_cache(POOL, BLOCK)
        gen = torch.Generator().manual_seed(0)
        for pool in (*self.kv.keys, *self.kv.values):
            pool.copy_(torch.randn(pool.shape, generator=gen))
        backend = FaultInjectingBackend(TorchBackend(), plan)
        layout = PageTableLayout(BLOCK, 16, POOL)
        self.runtime = build_runtime(
            FaultInjectingModel(model, plan), backend=backend, kv=self.kv, layout=layout, policy=POLICY
        )
        self.executor = PrefillExecutor(self.runtime)
        need = [ceil_div(n, BLOCK) for n in scenario.lengths]
        self.table = torch.full((len(need), max(need) + 1), -1, dtype=torch.int32)
        first = 0
        for row, n in enumerate(need):
            self.table[row, :n] = torch.arange(first, first + n)
            self.table[row, n] = (first + n + 7) % POOL  # stale tail
            first += n
        self.tokens = torch.randint(1, 256, (len(need), max(scenario.lengths)), generator=gen)
        self.written = {
            int(b)
            for row, (n, cached) in enumerate(zip(need, scenario.cached))
            for b in self.table[row, cached // BLOCK : n].tolist()
        }
        self._fill_prefixes()

    def _fill_prefixes(self) -> None:
        rows = [r for r, c in enumerate(self.scenario.cached) if c]
        if rows:
            prefixes = [self.tokens[r, : self.scenario.cached[r]].tolist() for r in rows]
            self.runtime.prefill(prefixes, self.table[rows], [self.scenario.cached[r] for r in rows])

    def call(self):
        s = self.scenario
        cached = list(s.cached)
        call = (self.tokens, self.table, list(s.lengths), cached, None, list(s.sampling))
        if s.mode == "traced":  # warm up what the traced call will plan
            self.executor.warm_up(WarmupManifest().observe(self.runtime.prepare(*call, mode=s.mode).requests))
        return self.executor.prefill(*call, mode=s.mode)

    def blocks_bytes(self) -> torch.Tensor:
        return self.kv.snapshot().contiguous().view(torch.uint8)


def _same(a, b) -> bool:
    return all(
        x.row == y.row
        and x.token == y.token
        and x.logprob == y.logprob
        and x.top_logprobs == y.top_logprobs
        and ((x.logits is None and y.logits is None) or torch.equal(x.logits, y.logits))
        for x, y in zip(a, b)
    ) and len(a) == len(b)


@contextlib.contextmanager
def single_threaded():
    """Runs the block with one intra-op torch thread.

    A tiny model's ops are too small to split, and on shared cores extra
    threads only contend; the sweep measures ownership, not speed.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@attrs.frozen
class _Point:
    """What one failed fault point did."""

    raised: bool = False
    unchanged: bool = False
    absorbed: bool = False
    noted: bool = False
    leaked: int = 0
    corrupted: int = 0
    wrong: bool = False


def _fail_point(model, scenario: Scenario, n: int, raises: type[BaseException], expected) -> _Point:
    plan = FaultPlan(raises=raises)
    harness = _Harness(model, scenario, plan)
    before = harness.blocks_bytes()
    plan.arm(n, failing_releases=2)
    outcome = {}
    try:
        harness.call()
    except BaseException as error:
        if plan.fired is None or (error is not plan.fired and not isinstance(error, Exception)):
            raise  # a real interrupt or exit, not ours
        notes = getattr(error, "__notes__", ())
        outcome = dict(raised=True, unchanged=error is plan.fired, noted=any("cleanup" in n for n in notes))
    else:
        # Only a failed release is not the caller's error: it must be an orphan.
        outcome = dict(absorbed=plan.log[n - 1].startswith("release:") and bool(harness.runtime.orphans))
    plan.arm(None)
    harness.runtime.cleanup()
    after = harness.blocks_bytes()
    outside = [b for b in range(POOL) if b not in harness.written]
    corrupted = int((before[:, :, outside] != after[:, :, outside]).sum())
    wrong = not _same(harness.call(), expected)
    harness.executor.close()
    return _Point(**outcome, leaked=len(harness.runtime.backend.ledger.live()), corrupted=corrupted, wrong=wrong)


def sweep(
    model,
    scenario: Scenario,
    limit: int | None = None,
    on_point: Callable[[int], None] | None = None,
    raises: type[BaseException] = InjectedFault,
    stride: int = 1,
) -> SweepReport:
    """Fails each fault point of ``scenario`` in turn with ``raises`` (the first ``limit``, every ``stride``-th)."""
    with single_threaded():
        counter = FaultPlan()
        oracle = _Harness(model, scenario, counter)
        counter.arm(None)  # count the call's fault points only, not the cached prefixes' fill
        expected = oracle.call()
        total = counter.calls
        points = []
        for n in range(1, (total if limit is None else min(total, limit)) + 1, stride):
            points.append(_fail_point(model, scenario, n, raises, expected))
            if on_point is not None:
                on_point(n)

    def count(field: str) -> int:
        return sum(int(getattr(p, field)) for p in points)

    return SweepReport(
        scenario.name,
        raises.__name__,
        total,
        len(points),
        count("raised"),
        count("unchanged"),
        count("absorbed"),
        count("noted"),
        count("leaked"),
        count("corrupted"),
        count("wrong"),
    )
