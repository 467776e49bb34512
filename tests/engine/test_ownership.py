"""Ownership of device tensors: the ledger empties, failures keep the primary error, input errors allocate nothing.

Collaborators are wrapped in ``prefill_shell.testing``'s fault wrappers (a plan
fails the N-th call of a kind, then the releases after it) so each test sees the
runtime from outside; a clean counting run finds each fault point's number.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from prefill_core import SamplingParams
from prefill_core.values.errors import PrefillInputError, PrefillStateError
from prefill_shell.backends import TorchBackend
from prefill_shell.testing import FaultInjectingBackend, FaultInjectingModel, FaultPlan, InjectedFault
from tests.helpers import (
    CHUNK_256_POLICY,
    TOL,
    assign_blocks,
    build_runtime,
    make_tokens,
    max_abs_diff,
    page_table,
    token_matrix,
)

BS = 16
NUM_BLOCKS = 64


class _ReleaseRecorder(FaultInjectingBackend):
    """The shipped fault wrapper, also noting each handle's release attempts and the handles whose release raised."""

    def __init__(self, inner, plan):
        super().__init__(inner, plan)
        self.attempts: Counter[int] = Counter()
        self.failed: list = []

    def release(self, handle):
        self.attempts[handle.id] += 1
        try:
            super().release(handle)
        except InjectedFault:
            self.failed.append(handle)
            raise


class _LedgerObservingModel(FaultInjectingModel):
    """Records the names of the live ledger handles at the start of every body call."""

    def __init__(self, inner, ledger):
        super().__init__(inner, FaultPlan(kinds=()))
        self.ledger = ledger
        self.live_at_body: list[list[str]] = []

    def forward_hidden(self, *args):
        self.live_at_body.append([h.name for h in self.ledger.live()])
        return super().forward_hidden(*args)


def _faulty_runtime(tiny_model, plan):
    """A runtime whose model and backend both tick ``plan``; the backend is a ``_ReleaseRecorder``."""
    backend = _ReleaseRecorder(TorchBackend(), plan)
    model = FaultInjectingModel(tiny_model, plan)
    kv = tiny_model.new_kv_cache(NUM_BLOCKS, BS)
    rt = build_runtime(model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY, backend=backend, kv=kv)
    return rt, backend


def _counted_log(tiny_model, kinds, run):
    """The fault plan's log of a clean ``run``: every call of ``kinds``, in order."""
    plan = FaultPlan(kinds=kinds)
    run(_faulty_runtime(tiny_model, plan)[0])
    return list(plan.log)


def _call_number(tiny_model, kinds, entry, occurrence, run):
    """The 1-based number, among calls of ``kinds``, of the ``occurrence``-th call logged as ``entry``, clean run."""
    numbers = [n for n, logged in enumerate(_counted_log(tiny_model, kinds, run), 1) if logged == entry]
    assert len(numbers) >= occurrence, f"{entry} happened {len(numbers)} times in a clean run"
    return numbers[occurrence - 1]


def _mixed_request():
    """A wave, a chunked row and rows on every sampling path: (tokens, table, lengths, sampling)."""
    lengths = [60, 45, 300, 200, 90, 33]
    rows = [make_tokens(n, seed=1100 + i) for i, n in enumerate(lengths)]
    sampling = [
        None,
        None,
        SamplingParams.greedy(num_logprobs=3),
        SamplingParams(top_k=5, seed=1, num_logprobs=2),
        SamplingParams(top_k=0, seed=2, num_logprobs=4),
        SamplingParams(temperature=0.5, top_k=40, seed=3),
    ]
    table = page_table(assign_blocks(lengths, BS, NUM_BLOCKS, seed=11))
    return token_matrix(rows), table, lengths, sampling


# ---------------------------------------------------------------- ledger empties


def test_prefill_leaves_ledger_empty(tiny_model):
    """After a mixed prefill (wave, chunked row, every sampling path) every allocation has been released."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    tokens, table, lengths, sampling = _mixed_request()
    batch = rt.prepare(tokens, table, lengths, sampling=sampling)
    assert len({p.sampling_path for p in batch.requests}) == 4
    rt.assemble(rt.invocations(batch), batch.num_rows)
    ledger = rt.backend.ledger
    assert ledger.allocations > 0
    assert ledger.live() == [] and ledger.releases == ledger.allocations
    assert rt.orphans == []


def test_invocations_hold_outputs_until_assemble_then_cleanup_leaves_ledger_empty(tiny_model):
    """Invocations held by the caller keep only their outputs live; assemble releases them and cleanup finds nothing."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    tokens, table, lengths, sampling = _mixed_request()
    batch = rt.prepare(tokens, table, lengths, sampling=sampling)
    invocations = [rt.invoke(batch, i) for i in range(len(batch.requests))]
    kept = {h.id for inv in invocations for h in inv.owned}
    assert {h.id for h in rt.backend.ledger.live()} == kept
    assert kept == {h.id for inv in invocations for h in inv.outputs.values()}
    rt.assemble(iter(invocations), batch.num_rows)
    rt.cleanup()
    assert rt.backend.ledger.live() == [] and rt.orphans == []


def test_non_final_chunk_hidden_is_released_before_next_chunk_runs(tiny_model):
    """While each chunk's body runs, no earlier chunk's hidden output (nor its token input) is still live."""
    backend = TorchBackend()
    model = _LedgerObservingModel(tiny_model, backend.ledger)
    kv = tiny_model.new_kv_cache(NUM_BLOCKS, BS)
    rt = build_runtime(model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY, backend=backend, kv=kv)
    tokens = make_tokens(600, seed=1200)
    rt.prefill(tokens[None], page_table(assign_blocks([600], BS, NUM_BLOCKS, seed=12)), [600])
    assert len(model.live_at_body) == 3
    for call, names in enumerate(model.live_at_body):
        assert "hidden" not in names, f"body call {call}: {names}"
        assert names.count("input_tokens") == 1, f"body call {call}: {names}"
    assert backend.ledger.live() == []


# ---------------------------------------------------------------- failures


FAILING_CALL = {"body": ("body:forward_hidden[1x256]", 2), "lm_head": ("body:lm_head", 1)}
"""Where each failure is injected: the second chunk's body call (600 tokens run as 256 + 256 + 88), the LM head."""


def _chunked_run(rt):
    """Prefills a 600-token chunked row (three body calls, then the LM head)."""
    tokens = make_tokens(600, seed=1300)
    rt.prefill(tokens[None], page_table(assign_blocks([600], BS, NUM_BLOCKS, seed=13)), [600])


def _failing_runtime(tiny_model, where):
    """A runtime failing at ``FAILING_CALL[where]``, whose next release then fails too; its plan and backend."""
    fail_at = _call_number(tiny_model, ("body", "release"), *FAILING_CALL[where], _chunked_run)
    plan = FaultPlan(fail_at, kinds=("body", "release"), failing_releases=1)
    rt, backend = _faulty_runtime(tiny_model, plan)
    return rt, plan, backend


def _fail_once(rt):
    """Runs the 600-token chunked row, which fails; returns the raised error."""
    with pytest.raises(BaseException) as info:
        _chunked_run(rt)
    return info.value


@pytest.mark.parametrize("where", ["body", "lm_head"])
def test_injected_failure_propagates_unchanged_with_cleanup_failure_as_note(tiny_model, where):
    """The model's own error reaches the caller unchanged; the release that failed meanwhile rides along as a note."""
    rt, plan, backend = _failing_runtime(tiny_model, where)
    error = _fail_once(rt)
    assert error is plan.fired and type(error) is InjectedFault
    entry = FAILING_CALL[where][0]
    assert str(error) == f"injected fault at call {plan.fail_at} ({entry.replace(':', ': ', 1)})"
    assert len(backend.failed) == 1
    cleanup = [n for n in getattr(error, "__notes__", []) if n.startswith("cleanup:")]
    assert len(cleanup) == 1 and "injected release failure" in cleanup[0]


@pytest.mark.parametrize("where", ["body", "lm_head"])
def test_failed_release_stays_orphan_until_cleanup_empties_ledger(tiny_model, where):
    """After a failing run only the handle whose release failed is live, as an orphan; cleanup releases it."""
    rt, _, backend = _failing_runtime(tiny_model, where)
    _fail_once(rt)
    assert [h.id for h in rt.orphans] == [h.id for h in backend.failed]
    assert [h.id for h in backend.ledger.live()] == [h.id for h in backend.failed]
    rt.cleanup()
    assert backend.ledger.live() == [] and rt.orphans == []


@pytest.mark.parametrize("where", ["body", "lm_head"])
def test_runtime_serves_next_request_correctly_after_failure(tiny_model, oracle, where):
    """Once a failed run is cleaned up, the same runtime prefills a chunked row and a wave to the oracle's logits."""
    rt, _, backend = _failing_runtime(tiny_model, where)
    _fail_once(rt)
    rt.cleanup()
    lengths = [600, 70, 110]
    rows = [make_tokens(n, seed=1400 + i) for i, n in enumerate(lengths)]
    table = page_table(assign_blocks(lengths, BS, NUM_BLOCKS, seed=13))  # overlaps the failed run's blocks
    results = rt.prefill(token_matrix(rows), table, lengths)
    for i, tokens in enumerate(rows):
        assert max_abs_diff(results[i].logits, oracle.logits(tokens)) <= TOL, f"row {i}"
    assert backend.ledger.live() == []


def test_read_failure_during_assemble_releases_outputs_and_keeps_primary_error(tiny_model):
    """A failed read propagates unchanged, its outputs are released, and a release failing meanwhile is noted on it."""
    tokens = make_tokens(70, seed=1500)

    def run(rt):
        rt.prefill(tokens[None], page_table([[1, 2, 3, 4, 5]]), [70])

    kinds = ("readback", "release")
    first_read = next(n for n, e in enumerate(_counted_log(tiny_model, kinds, run), 1) if e.startswith("readback:"))
    plan = FaultPlan(first_read, kinds=kinds, failing_releases=1)
    rt, backend = _faulty_runtime(tiny_model, plan)
    with pytest.raises(InjectedFault, match=r"\(readback: ") as info:
        run(rt)
    assert info.value is plan.fired
    assert any("injected release failure" in note for note in getattr(info.value, "__notes__", []))
    assert len(backend.failed) == 1
    assert [h.id for h in backend.ledger.live()] == [h.id for h in rt.orphans] == [h.id for h in backend.failed]
    rt.cleanup()
    assert backend.ledger.live() == []


# ---------------------------------------------------------------- state errors


def test_assembling_same_invocation_twice_raises_state_error(tiny_model):
    """Assembling an InvocationResult again raises PrefillStateError before reading or releasing anything."""
    plan = FaultPlan(kinds=("readback",))  # counts reads, fails none
    rt, backend = _faulty_runtime(tiny_model, plan)
    tokens = make_tokens(50, seed=1600)
    batch = rt.prepare(tokens[None], page_table([[7, 8, 9, 10]]), [50])
    invocation = rt.invoke(batch, 0)
    rt.assemble(iter([invocation]), batch.num_rows)
    reads, releases = plan.calls, backend.ledger.releases
    assert reads > 0
    with pytest.raises(PrefillStateError):
        rt.assemble(iter([invocation]), batch.num_rows)
    assert (plan.calls, backend.ledger.releases) == (reads, releases)
    assert backend.ledger.live() == []


# ---------------------------------------------------------------- bad input


def _valid_call():
    tokens = torch.randint(1, 256, (2, 64), generator=torch.Generator().manual_seed(17))
    table = torch.tensor([[1, 2, 3, 4, -1, -1], [5, 6, 7, -1, -1, -1]], dtype=torch.int32)
    return dict(tokens=tokens, page_table=table, prompt_lengths=[64, 40])


BAD_INPUTS = {
    "tokens-float": lambda c: c.update(tokens=c["tokens"].float()),
    "tokens-1d": lambda c: c.update(tokens=c["tokens"][0]),
    "tokens-3d": lambda c: c.update(tokens=c["tokens"][None]),
    "page_table-float": lambda c: c.update(page_table=c["page_table"].float()),
    "page_table-1d": lambda c: c.update(page_table=c["page_table"][0]),
    "page_table-extra-row": lambda c: c.update(page_table=torch.cat([c["page_table"], c["page_table"][:1]])),
    "page_table-too-narrow": lambda c: c.update(page_table=c["page_table"][:, :3]),
    "page_table-block-out-of-range": lambda c: c["page_table"].__setitem__((1, 2), NUM_BLOCKS),
    "page_table-negative-mapped-block": lambda c: c["page_table"].__setitem__((0, 1), -1),
    "page_table-block-written-twice": lambda c: c["page_table"].__setitem__((1, 0), 3),
    "prompt_lengths-three-values": lambda c: c.update(prompt_lengths=[64, 40, 10]),
    "prompt_lengths-float": lambda c: c.update(prompt_lengths=[64.0, 40]),
    "prompt_lengths-2d-tensor": lambda c: c.update(prompt_lengths=torch.tensor([[64, 40]])),
    "prompt_lengths-zero": lambda c: c.update(prompt_lengths=[64, 0]),
    "prompt_lengths-beyond-tokens": lambda c: c.update(prompt_lengths=[65, 40]),
    "cached_lengths-one-value": lambda c: c.update(cached_lengths=[0]),
    "cached_lengths-negative": lambda c: c.update(cached_lengths=[-1, 0]),
    "cached_lengths-beyond-length": lambda c: c.update(cached_lengths=[0, 48]),
    "slots-duplicate": lambda c: c.update(slots=[3, 3]),
    "slots-beyond-lane": lambda c: c.update(slots=[0, 32]),
    "sampling-one-entry": lambda c: c.update(sampling=[None]),
    "sampling-not-params": lambda c: c.update(sampling=[None, {"top_k": 5}]),
    "sampling-top_p-above-one": lambda c: c.update(sampling=[None, SamplingParams(top_p=1.5)]),
    "sampling-too-many-logprobs": lambda c: c.update(sampling=[None, SamplingParams.greedy(num_logprobs=21)]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_input_error_and_allocates_nothing(tiny_model, case):
    """Malformed caller input raises a named PrefillInputError before any allocation or KV write."""
    rt = build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=CHUNK_256_POLICY)
    rt.prefill(**_valid_call())  # the unmodified call is accepted
    call = _valid_call()
    BAD_INPUTS[case](call)
    ledger, kv = rt.backend.ledger, rt.config.kv
    allocations, pool = ledger.allocations, kv.snapshot().view(torch.uint8)
    with pytest.raises(PrefillInputError) as info:
        rt.prefill(**call)
    assert info.value.field, "the error names the offending field"
    assert ledger.allocations == allocations and ledger.live() == []
    assert torch.equal(kv.snapshot().view(torch.uint8), pool)


def test_a_prompt_past_the_models_max_position_is_refused_before_anything_runs():
    """max_position_embeddings=4000 at block 64: a 4032-token prompt (the capacity) raises PositionLimitError."""
    from prefill_core.values.errors import PositionLimitError
    from prefill_shell.reference import random_llama

    model = random_llama(0, "tiny", max_position_embeddings=4000)
    rt = build_runtime(model, num_blocks=64, block_size=64)
    assert rt.config.layout.capacity == 4032
    tokens = torch.randint(1, 256, (1, 4032), generator=torch.Generator().manual_seed(5))
    pool = rt.config.kv.snapshot().view(torch.uint8).clone()
    with pytest.raises(PositionLimitError, match="4000") as info:
        rt.prefill(tokens, torch.arange(63, dtype=torch.int32)[None], [4032])
    assert info.value.row == 0
    assert rt.backend.ledger.allocations == 0
    assert torch.equal(rt.config.kv.snapshot().view(torch.uint8), pool)
    assert len(rt.prepare(tokens, torch.arange(63, dtype=torch.int32)[None], [4000]).requests) == 1


def test_a_failed_intermediate_release_is_orphaned_and_released_once_by_cleanup(tiny_model):
    """A non-final chunk output whose release fails is an orphan the invocation never retries; cleanup frees it once."""
    tokens = make_tokens(600, seed=1700)

    def run(rt):
        rt.prefill(tokens[None], page_table(assign_blocks([600], BS, NUM_BLOCKS, seed=17)), [600])

    plan = FaultPlan(_call_number(tiny_model, ("release",), "release:hidden", 1, run), kinds=("release",))
    rt, backend = _faulty_runtime(tiny_model, plan)
    run(rt)
    assert len(backend.failed) == 1, "the 600-token row ran more than one chunk"
    failed = backend.failed[0]
    assert failed.name == "hidden"
    assert [h.id for h in rt.orphans] == [failed.id] and not failed.released
    assert backend.attempts[failed.id] == 1, "the invocation released its orphan again"
    assert [h.id for h in backend.ledger.live()] == [failed.id]
    rt.cleanup()
    assert failed.released and backend.attempts[failed.id] == 2
    assert rt.orphans == [] and backend.ledger.live() == []
