"""Ownership of device tensors: the ledger empties, failures keep the primary error, input errors allocate nothing.

Collaborators are wrapped (a model that observes or fails, a backend whose
``release`` fails on demand) so each test sees the runtime from outside.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import SamplingParams
from prefill_core.errors import PrefillInputError, PrefillStateError
from prefill_shell.backends import TorchBackend

BS = 16
NUM_BLOCKS = 64


class _ModelProxy:
    """Implements the model protocol by delegating to ``inner``; subclasses hook the calls."""

    def __init__(self, inner):
        self.inner = inner
        self.spec = inner.spec
        self.dtype = inner.dtype
        self.body_calls = 0

    def new_kv_cache(self, num_blocks, block_size):
        return self.inner.new_kv_cache(num_blocks, block_size)

    def forward_hidden(self, tokens, start, fill_table, read_table, kv):
        self.body_calls += 1
        return self.inner.forward_hidden(tokens, start, fill_table, read_table, kv)

    def lm_head(self, hidden_rows):
        return self.inner.lm_head(hidden_rows)


class _LedgerObservingModel(_ModelProxy):
    """Records the names of the live ledger handles at the start of every body call."""

    def __init__(self, inner, ledger):
        super().__init__(inner)
        self.ledger = ledger
        self.live_at_body: list[list[str]] = []

    def forward_hidden(self, *args):
        self.live_at_body.append([h.name for h in self.ledger.live()])
        return super().forward_hidden(*args)


class _FlakyBackend(TorchBackend):
    """A torch backend whose next ``fail_releases`` releases raise (leaving the handle live)."""

    def __init__(self):
        super().__init__()
        self.fail_releases = 0
        self.failed: list = []

    def release(self, handle):
        if self.fail_releases:
            self.fail_releases -= 1
            self.failed.append(handle)
            raise RuntimeError(f"injected release failure of {handle.name}")
        super().release(handle)


class _InjectedFailure(RuntimeError):
    pass


class _FailingModel(_ModelProxy):
    """Raises once at a chosen call (``body`` call ``n`` or the first ``lm_head``), arming one release failure first."""

    def __init__(self, inner, backend, where: str, body_call: int = 2):
        super().__init__(inner)
        self.backend, self.where, self.body_call = backend, where, body_call
        self.raised: BaseException | None = None

    def _fail(self):
        self.backend.fail_releases = 1
        self.raised = _InjectedFailure(f"injected {self.where} failure")
        raise self.raised

    def forward_hidden(self, *args):
        if self.where == "body" and self.raised is None and self.body_calls + 1 == self.body_call:
            self.body_calls += 1
            self._fail()
        return super().forward_hidden(*args)

    def lm_head(self, hidden_rows):
        if self.where == "lm_head" and self.raised is None:
            self._fail()
        return super().lm_head(hidden_rows)


def _mixed_request(kit):
    """A wave, a chunked row and rows on every sampling path: (tokens, table, lengths, sampling)."""
    lengths = [60, 45, 300, 200, 90, 33]
    rows = [kit.make_tokens(n, seed=1100 + i) for i, n in enumerate(lengths)]
    sampling = [
        None,
        None,
        SamplingParams.greedy(num_logprobs=3),
        SamplingParams(top_k=5, seed=1, num_logprobs=2),
        SamplingParams(top_k=0, seed=2, num_logprobs=4),
        SamplingParams(temperature=0.5, top_k=40, seed=3),
    ]
    table = kit.page_table(kit.assign_blocks(lengths, BS, NUM_BLOCKS, seed=11))
    return kit.token_matrix(rows), table, lengths, sampling


# ---------------------------------------------------------------- ledger empties


def test_prefill_leaves_ledger_empty(tiny_model, kit):
    """After a mixed prefill (wave, chunked row, every sampling path) every allocation has been released."""
    rt = kit.build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=kit.SMALL_POLICY)
    tokens, table, lengths, sampling = _mixed_request(kit)
    batch = rt.prepare(tokens, table, lengths, sampling=sampling)
    assert len({p.sampling_path for p in batch.requests}) == 4
    rt.assemble(rt.invocations(batch), batch.num_rows)
    ledger = rt.backend.ledger
    assert ledger.allocations > 0
    assert ledger.live() == [] and ledger.releases == ledger.allocations
    assert rt.orphans == []


def test_invocations_hold_outputs_until_assemble_then_cleanup_leaves_ledger_empty(tiny_model, kit):
    """Invocations held by the caller keep only their outputs live; assemble releases them and cleanup finds nothing."""
    rt = kit.build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=kit.SMALL_POLICY)
    tokens, table, lengths, sampling = _mixed_request(kit)
    batch = rt.prepare(tokens, table, lengths, sampling=sampling)
    invocations = [rt.invoke(batch, i) for i in range(len(batch.requests))]
    kept = {h.id for inv in invocations for h in inv.owned}
    assert {h.id for h in rt.backend.ledger.live()} == kept
    assert kept == {h.id for inv in invocations for h in inv.outputs.values()}
    rt.assemble(iter(invocations), batch.num_rows)
    rt.cleanup()
    assert rt.backend.ledger.live() == [] and rt.orphans == []


def test_non_final_chunk_hidden_is_released_before_next_chunk_runs(tiny_model, kit):
    """While each chunk's body runs, no earlier chunk's hidden output (nor its token input) is still live."""
    backend = TorchBackend()
    model = _LedgerObservingModel(tiny_model, backend.ledger)
    rt = kit.build_runtime(model, num_blocks=NUM_BLOCKS, block_size=BS, policy=kit.SMALL_POLICY, backend=backend)
    tokens = kit.make_tokens(600, seed=1200)
    rt.prefill(tokens[None], kit.page_table(kit.assign_blocks([600], BS, NUM_BLOCKS, seed=12)), [600])
    assert len(model.live_at_body) == 3
    for call, names in enumerate(model.live_at_body):
        assert "hidden" not in names, f"body call {call}: {names}"
        assert names.count("input_tokens") == 1, f"body call {call}: {names}"
    assert backend.ledger.live() == []


# ---------------------------------------------------------------- failures


def _failing_runtime(tiny_model, kit, where):
    backend = _FlakyBackend()
    model = _FailingModel(tiny_model, backend, where)
    rt = kit.build_runtime(model, num_blocks=NUM_BLOCKS, block_size=BS, policy=kit.SMALL_POLICY, backend=backend)
    return rt, model, backend


def _fail_once(rt, kit):
    """Runs a 600-token chunked row that fails; returns the raised error."""
    tokens = kit.make_tokens(600, seed=1300)
    with pytest.raises(BaseException) as info:
        rt.prefill(tokens[None], kit.page_table(kit.assign_blocks([600], BS, NUM_BLOCKS, seed=13)), [600])
    return info.value


@pytest.mark.parametrize("where", ["body", "lm_head"])
def test_injected_failure_propagates_unchanged_with_cleanup_failure_as_note(tiny_model, kit, where):
    """The model's own error reaches the caller unchanged; the release that failed meanwhile rides along as a note."""
    rt, model, backend = _failing_runtime(tiny_model, kit, where)
    error = _fail_once(rt, kit)
    assert error is model.raised and type(error) is _InjectedFailure
    assert str(error) == f"injected {where} failure"
    assert len(backend.failed) == 1
    cleanup = [n for n in getattr(error, "__notes__", []) if n.startswith("cleanup:")]
    assert len(cleanup) == 1 and "injected release failure" in cleanup[0]


@pytest.mark.parametrize("where", ["body", "lm_head"])
def test_failed_release_stays_orphan_until_cleanup_empties_ledger(tiny_model, kit, where):
    """After a failing run only the handle whose release failed is live, as an orphan; cleanup releases it."""
    rt, _, backend = _failing_runtime(tiny_model, kit, where)
    _fail_once(rt, kit)
    assert [h.id for h in rt.orphans] == [h.id for h in backend.failed]
    assert [h.id for h in backend.ledger.live()] == [h.id for h in backend.failed]
    rt.cleanup()
    assert backend.ledger.live() == [] and rt.orphans == []


@pytest.mark.parametrize("where", ["body", "lm_head"])
def test_runtime_serves_next_request_correctly_after_failure(tiny_model, oracle, kit, where):
    """Once a failed run is cleaned up, the same runtime prefills a chunked row and a wave to the oracle's logits."""
    rt, _, backend = _failing_runtime(tiny_model, kit, where)
    _fail_once(rt, kit)
    rt.cleanup()
    lengths = [600, 70, 110]
    rows = [kit.make_tokens(n, seed=1400 + i) for i, n in enumerate(lengths)]
    table = kit.page_table(kit.assign_blocks(lengths, BS, NUM_BLOCKS, seed=13))  # overlaps the failed run's blocks
    results = rt.prefill(kit.token_matrix(rows), table, lengths)
    for i, tokens in enumerate(rows):
        assert kit.max_abs_diff(results[i].logits, oracle.logits(tokens)) <= kit.TOL, f"row {i}"
    assert backend.ledger.live() == []


def test_read_failure_during_assemble_releases_outputs_and_keeps_primary_error(tiny_model, kit):
    """A failed read propagates unchanged, its outputs are released, and a release failing meanwhile is noted on it."""

    class ReadFails(_FlakyBackend):
        def read(self, handles):
            self.fail_releases = 1
            raise _InjectedFailure("injected read failure")

    backend = ReadFails()
    rt = kit.build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=kit.SMALL_POLICY, backend=backend)
    tokens = kit.make_tokens(70, seed=1500)
    with pytest.raises(_InjectedFailure, match="injected read failure") as info:
        rt.prefill(tokens[None], kit.page_table([[1, 2, 3, 4, 5]]), [70])
    assert any("injected release failure" in note for note in getattr(info.value, "__notes__", []))
    assert [h.id for h in backend.ledger.live()] == [h.id for h in rt.orphans] == [h.id for h in backend.failed]
    rt.cleanup()
    assert backend.ledger.live() == []


# ---------------------------------------------------------------- state errors


def test_assembling_same_invocation_twice_raises_state_error(tiny_model, kit):
    """Assembling an InvocationResult again raises PrefillStateError before reading or releasing anything."""

    class CountingReads(TorchBackend):
        reads = 0

        def read(self, handles):
            self.reads += 1
            return super().read(handles)

    backend = CountingReads()
    rt = kit.build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=kit.SMALL_POLICY, backend=backend)
    tokens = kit.make_tokens(50, seed=1600)
    batch = rt.prepare(tokens[None], kit.page_table([[7, 8, 9, 10]]), [50])
    invocation = rt.invoke(batch, 0)
    rt.assemble(iter([invocation]), batch.num_rows)
    reads, releases = backend.reads, backend.ledger.releases
    with pytest.raises(PrefillStateError):
        rt.assemble(iter([invocation]), batch.num_rows)
    assert (backend.reads, backend.ledger.releases) == (reads, releases)
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
    "cached_lengths-not-block-multiple": lambda c: c.update(cached_lengths=[8, 0]),
    "cached_lengths-beyond-length": lambda c: c.update(cached_lengths=[0, 48]),
    "slots-duplicate": lambda c: c.update(slots=[3, 3]),
    "slots-beyond-lane": lambda c: c.update(slots=[0, 32]),
    "sampling-one-entry": lambda c: c.update(sampling=[None]),
    "sampling-not-params": lambda c: c.update(sampling=[None, {"top_k": 5}]),
    "sampling-top_p-above-one": lambda c: c.update(sampling=[None, SamplingParams(top_p=1.5)]),
    "sampling-too-many-logprobs": lambda c: c.update(sampling=[None, SamplingParams.greedy(num_logprobs=21)]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_input_error_and_allocates_nothing(tiny_model, kit, case):
    """Malformed caller input raises a named PrefillInputError before any allocation or KV write."""
    rt = kit.build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=kit.SMALL_POLICY)
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


def test_a_prompt_past_the_models_max_position_is_refused_before_anything_runs(kit):
    """max_position_embeddings=4000 at block 64: a 4032-token prompt (the capacity) raises PositionLimitError."""
    from prefill_core.errors import PositionLimitError
    from prefill_shell.reference import random_llama

    model = random_llama(0, "tiny", max_position_embeddings=4000)
    rt = kit.build_runtime(model, num_blocks=64, block_size=64)
    assert rt.config.layout.capacity == 4032
    tokens = torch.randint(1, 256, (1, 4032), generator=torch.Generator().manual_seed(5))
    pool = rt.config.kv.snapshot().view(torch.uint8).clone()
    with pytest.raises(PositionLimitError, match="4000") as info:
        rt.prefill(tokens, torch.arange(63, dtype=torch.int32)[None], [4032])
    assert info.value.row == 0
    assert rt.backend.ledger.allocations == 0
    assert torch.equal(rt.config.kv.snapshot().view(torch.uint8), pool)
    assert len(rt.prepare(tokens, torch.arange(63, dtype=torch.int32)[None], [4000]).requests) == 1


def test_a_failed_intermediate_release_is_orphaned_and_released_once_by_cleanup(tiny_model, kit):
    """A non-final chunk output whose release fails is an orphan the invocation never retries; cleanup frees it once."""

    class FirstHiddenReleaseFails(TorchBackend):
        def __init__(self):
            super().__init__()
            self.attempts: dict[int, int] = {}
            self.failed = None

        def release(self, handle):
            self.attempts[handle.id] = self.attempts.get(handle.id, 0) + 1
            if handle.name == "hidden" and self.failed is None:
                self.failed = handle
                raise RuntimeError("injected release failure of a non-final hidden output")
            super().release(handle)

    backend = FirstHiddenReleaseFails()
    rt = kit.build_runtime(tiny_model, num_blocks=NUM_BLOCKS, block_size=BS, policy=kit.SMALL_POLICY, backend=backend)
    tokens = kit.make_tokens(600, seed=1700)
    rt.prefill(tokens[None], kit.page_table(kit.assign_blocks([600], BS, NUM_BLOCKS, seed=17)), [600])
    failed = backend.failed
    assert failed is not None, "the 600-token row ran more than one chunk"
    assert [h.id for h in rt.orphans] == [failed.id] and not failed.released
    assert backend.attempts[failed.id] == 1, "the invocation released its orphan again"
    assert [h.id for h in backend.ledger.live()] == [failed.id]
    rt.cleanup()
    assert failed.released and backend.attempts[failed.id] == 2
    assert rt.orphans == [] and backend.ledger.live() == []
