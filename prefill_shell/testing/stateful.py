"""``PrefillLifecycleMachine``: a hypothesis state machine over a runtime's whole lifecycle.

Rules interleave eager and traced prefill of generated batches (up to six
rows, more than one 4-slot lane; cached and fully cached prefixes, written
first on both runtimes), warm-up, layout changes (within and beyond the
ceiling), armed faults (``InjectedFault`` or ``KeyboardInterrupt``) and
cleanup.
Beside the runtime under test runs an oracle: the same model on its own KV
pool and backend, eager, never faulted. Invariants after every step:

* no leak: every live invocation-owned tensor is a recorded orphan (and
  after ``cleanup`` there are none);
* KV integrity: every pool block outside the blocks a call writes (cached
  prefixes are only read) is bit-identical before and after the call,
  faulted or not;
* results: a call that succeeds returns exactly the oracle's results;
* faults: an injected fault, an interrupt included, reaches the caller as
  the very same exception.

Use it on your own model or backend by subclassing and overriding
``make_model`` / ``make_backend`` (see ``run_lifecycle_machine``).
"""

from __future__ import annotations

import torch

from prefill_core import PageTableLayout, SamplingParams, WarmupManifest, ceil_div
from prefill_core.values.errors import PrefillConfigError
from prefill_shell.device.ledger import Ownership
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.extras import requires_extra

from ..backends import TorchBackend
from .faults import FaultInjectingBackend, FaultInjectingModel, FaultPlan, InjectedFault
from .runtime_builder import build_runtime
from .small import SMALL_BLOCK, SMALL_POLICY

with requires_extra("testing", __name__):
    from hypothesis import note, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

__all__ = ["PrefillLifecycleMachine", "run_lifecycle_machine"]

FAULT_TYPES = (InjectedFault, KeyboardInterrupt)

BLOCK, POLICY, POOL = SMALL_BLOCK, SMALL_POLICY, 96

_sampling = st.one_of(
    st.none(),
    st.builds(SamplingParams.greedy, num_logprobs=st.integers(0, 3)),
    st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.5, 1.0]),
        top_k=st.sampled_from([1, 3, 8, 40]),
        top_p=st.sampled_from([0.5, 1.0]),
        seed=st.integers(0, 2**31),
        num_logprobs=st.integers(0, 3),
    ),
)


class PrefillLifecycleMachine(RuleBasedStateMachine):
    """Lifecycle rules and invariants; override the factories to test your own parts."""

    def make_model(self):
        from ..reference import random_llama

        return random_llama(0, "tiny")

    def make_backend(self):
        return TorchBackend()

    def __init__(self):
        super().__init__()
        model = self.make_model()
        self.plan = FaultPlan()
        self.kv = model.new_kv_cache(POOL, BLOCK)
        self.backend = FaultInjectingBackend(self.make_backend(), self.plan)
        self.runtime = build_runtime(
            FaultInjectingModel(model, self.plan), backend=self.backend, kv=self.kv, policy=POLICY
        )
        self.executor = PrefillExecutor(self.runtime)
        self.oracle = build_runtime(
            model, backend=self.make_backend(), num_blocks=POOL, block_size=BLOCK, policy=POLICY
        )
        self.armed: tuple[int | None, type[BaseException]] = (None, InjectedFault)

    # -- generated calls ----------------------------------------------------
    def _call(self, data):
        num_blocks = self.runtime.config.layout.num_blocks
        rows = data.draw(st.integers(1, 6), label="rows")  # more than one 4-slot lane at times
        lengths = data.draw(st.lists(st.integers(1, 150), min_size=rows, max_size=rows), label="lengths")
        need = [ceil_div(n, BLOCK) for n in lengths]
        blocks = data.draw(st.permutations(range(num_blocks)), label="blocks")
        while sum(need) > num_blocks:
            lengths, need = lengths[:-1], need[:-1]
        cached = [BLOCK * data.draw(st.integers(0, n // BLOCK), label="cached blocks") for n in lengths]
        table = torch.full((len(lengths), max(need) + 2), -1, dtype=torch.int32)
        first = 0
        for row, n in enumerate(need):
            table[row, :n] = torch.tensor(blocks[first : first + n])
            # A stale tail past the mapped prefix: blocks of other rows (or of nobody).
            table[row, n:] = torch.tensor([blocks[j % 2] for j in range(table.shape[1] - n)], dtype=torch.int32)
            first += n
        sampling = data.draw(st.lists(_sampling, min_size=len(lengths), max_size=len(lengths)), label="sampling")
        seed = data.draw(st.integers(0, 2**31), label="token seed")
        tokens = torch.randint(1, 256, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(seed))
        # Cached-prefix blocks are only read: a byte changed there is corruption.
        written = {int(b) for row, n in enumerate(need) for b in table[row, cached[row] // BLOCK : n].tolist()}
        return tokens, table, lengths, cached, sampling, written

    def _fill_prefixes(self, tokens, table, cached) -> None:
        """Writes each cached row's prefix KV (unfaulted) on the runtime and on the oracle alike."""
        rows = [r for r, c in enumerate(cached) if c]
        if rows:
            prefixes = [tokens[r, : cached[r]].tolist() for r in rows]
            for runtime in (self.runtime, self.oracle):
                runtime.prefill(prefixes, table[rows], [cached[r] for r in rows])

    def _run(self, data, mode: str) -> None:
        tokens, table, lengths, cached, sampling, written = self._call(data)
        note(f"{mode}: lengths={lengths} cached={cached} sampling={sampling} armed={self.armed}")
        self._fill_prefixes(tokens, table, cached)
        before = self.kv.snapshot()
        fail_at, self.plan.raises = self.armed
        self.plan.arm(fail_at)
        self.armed = (None, InjectedFault)
        try:
            if mode == "traced":
                prepared = self.runtime.prepare(tokens, table, lengths, cached, sampling=sampling).requests
                self.executor.warm_up(WarmupManifest().observe(prepared))
            results = self.executor.prefill(tokens, table, lengths, cached, sampling=sampling, mode=mode)
        except BaseException as error:
            if self.plan.fired is None or error is not self.plan.fired:
                raise
            results = None
        finally:
            self.plan.arm(None)
        after = self.kv.snapshot()
        untouched = [b for b in range(self.kv.num_blocks) if b not in written]
        assert torch.equal(before[:, :, untouched], after[:, :, untouched]), "a call wrote KV outside its own blocks"
        if results is not None:
            self._check_against_oracle(results, tokens, table, lengths, cached, sampling)

    def _check_against_oracle(self, results, tokens, table, lengths, cached, sampling) -> None:
        expected = self.oracle.prefill(tokens, table, lengths, cached, sampling=sampling)
        for got, want in zip(results, expected):
            assert got.row == want.row and got.token == want.token and got.logprob == want.logprob
            assert got.top_logprobs == want.top_logprobs
            assert (got.logits is None) == (want.logits is None)
            if got.logits is not None:
                assert torch.equal(got.logits, want.logits), f"row {got.row}: logits differ from the oracle"

    # -- rules ------------------------------------------------------------
    @rule(data=st.data())
    def eager_prefill(self, data):
        self._run(data, "eager")

    @rule(data=st.data())
    def traced_prefill(self, data):
        self._run(data, "traced")

    @rule(fail_at=st.integers(1, 40), raises=st.sampled_from(FAULT_TYPES))
    def arm_fault(self, fail_at, raises):
        self.armed = (fail_at, raises)

    @rule(num_blocks=st.integers(16, POOL))
    def shrink_layout(self, num_blocks):
        ceiling = self.runtime.config.layout_ceiling
        self.runtime.configure_page_table_layout(PageTableLayout(BLOCK, ceiling.max_num_blocks_per_seq, num_blocks))

    @rule()
    def layout_beyond_ceiling_is_refused(self):
        before = self.runtime.config
        ceiling = before.layout_ceiling
        try:
            self.runtime.configure_page_table_layout(PageTableLayout(BLOCK, ceiling.max_num_blocks_per_seq, POOL + 1))
        except PrefillConfigError:
            pass
        else:
            raise AssertionError("a layout beyond the KV pool was accepted")
        assert self.runtime.config is before

    @precondition(lambda self: bool(self.runtime.orphans))
    @rule()
    def cleanup(self):
        self.runtime.cleanup()
        assert not self.runtime.orphans

    # -- invariants ---------------------------------------------------------
    @invariant()
    def no_untracked_transients(self):
        live = self.backend.ledger.live(Ownership.INVOCATION)
        orphans = {id(h) for h in self.runtime.orphans}
        assert all(id(h) in orphans for h in live), f"leaked invocation tensors: {live}"

    def teardown(self):
        self.plan.arm(None)
        self.executor.close()
        assert not self.backend.ledger.live(), f"live after close: {self.backend.ledger.live()}"


def run_lifecycle_machine(machine: type[PrefillLifecycleMachine] = PrefillLifecycleMachine, **setting_kwargs) -> None:
    """Runs ``machine`` under hypothesis (the active profile, overridden by ``setting_kwargs``)."""
    run_state_machine_as_test(machine, settings=settings(settings.default, **setting_kwargs))
