"""``PrefillRuntime``: the facade that composes the collaborators around one config.

prepare -> invoke -> assemble (or stream) -> cleanup / close, over private
collaborators (input stager, step loop, trace lifecycle, postprocessor,
result assembler) that share this runtime's identities on the eager and the
traced path. How to call it and the rules of a call (invocation lifetime,
one caller at a time, failures): docs/usage.md; how it is built (the request
path, ownership): docs/design.md. What sits above it (registries, warm-up,
the eager-or-traced choice) is ``PrefillExecutor``'s, which uses only the
public methods here.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch

from prefill_core import (
    ExecutionMode,
    PageTableLayout,
    PrefillProgramSignature,
    PrefillTraceSignature,
    PreparedPrefill,
    RequestKind,
    SamplingParams,
    SamplingPath,
    execution_mode,
    replays,
)
from prefill_core.calls.call_plan import CallContext, plan_call
from prefill_core.values.errors import CleanupError, PrefillInputError, PrefillStateError
from prefill_core.values.pooling import PoolingType
from prefill_core.values.sampling import refuse_per_row_extras
from prefill_shell.device.ledger import DeviceTensor
from prefill_shell.device.model import supports_segment_ends, supports_shared_writes
from prefill_shell.device.notes import add_note
from prefill_shell.engine.batch_builder import build_batch, check_token_ids
from prefill_shell.engine.call import PrefillCall, PrefillEntry
from prefill_shell.engine.call_guard import CallGuard, exclusive, exclusive_stream
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.progress import ProgressCallback, ProgressCounter
from prefill_shell.engine.result import BatchResult, InvocationResult, PrefillResult
from prefill_shell.engine.steps.assembler import PrefillResultAssembler
from prefill_shell.engine.steps.call_steps import body_call, call_steps
from prefill_shell.engine.steps.inputs import DeviceStep, PrefillInputStager
from prefill_shell.engine.steps.partial_writes import StepLog, note_partial_writes
from prefill_shell.engine.steps.pooled_states import pooled_states, with_pooled
from prefill_shell.engine.steps.postprocess import PrefillPostprocessor, wave_params
from prefill_shell.engine.steps.prepared_batch import PreparedBatch, check_runnable, checked_request
from prefill_shell.engine.steps.prompt_logprobs import (
    PromptLogprobCollector,
    prompt_steps,
    requested_spans,
)
from prefill_shell.engine.steps.step_loop import EagerSteps, PrefillStepLoop
from prefill_shell.engine.steps.token_agreement import MatrixAgreement
from prefill_shell.engine.steps.trace import CapturedTrace, PrefillTraceLifecycle, require_coverage, warmup_step

__all__ = ["PrefillRuntime", "PreparedBatch"]  # PreparedBatch re-exported: prepare returns it

_SEEDED_PATHS = (SamplingPath.TOPK, SamplingPath.HOST)


def _warmup_params(signature: PrefillProgramSignature) -> tuple:
    """Sampling parameters that exercise ``signature``'s postprocessing path."""
    b = signature.padded_batch
    if signature.sampling_path is SamplingPath.LOGITS:
        return (None,) * b
    if signature.sampling_path is SamplingPath.ARGMAX:
        return (SamplingParams.greedy(),) * b
    return (SamplingParams(top_k=2, top_p=0.9),) * b


class PrefillRuntime(PrefillEntry):
    """Plans, runs and collects prefill for one execution lane.

    Thread safety: one call at a time. A runtime owns one lane's device
    state (its KV pool, persistent trace inputs, workspaces that every replay
    overwrites), and a serving engine (vLLM's model runner, tt-metal's
    generator) drives a lane from one thread, so two overlapping calls are an
    engine bug: an entry from a second thread while a call is in progress
    raises ``PrefillStateError`` at once, before anything runs, instead of
    queueing behind a lock (a queued call would hide the bug, and a caller
    that keeps an unfinished ``invocations()`` generator would stall every
    other thread). A call is in progress from entry to return, and for a
    stream (``invocations``, ``stream``) from its first step until it is
    exhausted or closed. Sequential calls from different threads are fine;
    a stream is advanced on the thread that started it (another thread's
    ``next()`` is refused and the stream goes on; ``close()`` works from any
    thread). Use ``hold()`` to make several calls one.
    """

    def __init__(self, config: PrefillRuntimeConfig, *, seed: int = 0):
        self.config = config
        self.backend = config.backend
        self.orphans: list[DeviceTensor] = []
        self._rng = random.Random(seed)
        self._closed = False
        self._guard = CallGuard()
        self._stager = PrefillInputStager(self.backend)
        self._postprocessor = PrefillPostprocessor(self.backend, self._run_lm_head, config.policy.max_logprobs)
        self._eager = EagerSteps(self.backend, self._stager, self._run_body)
        # Where no hook reads a step's hidden rows beyond its segments' last tokens (no prompt log-probs, no
        # pooled state but LAST), a packed step needs only those: a model that says it can
        # (device.model.SEGMENT_ENDS_CAPABILITY) skips the rest of its last layer.
        ends = supports_segment_ends(config.model)
        ends_body = functools.partial(self._run_body, ends_only=True)
        self._eager_ends = EagerSteps(self.backend, self._stager, ends_body) if ends else self._eager
        # A model that writes a step's K/V into more slots (device.model.SHARED_WRITES_CAPABILITY) lets the plan
        # compute once the positions where rows begin alike (prefill_core.planning.shared_spans).
        self._shares_spans = config.packed_steps and supports_shared_writes(config.model)
        self._loop = PrefillStepLoop(self._postprocessor, self._release_handles)
        self._traces = PrefillTraceLifecycle(
            self.backend,
            self._stager,
            self._postprocessor,
            self._run_body,
            config.model.spec,
            config.model.dtype,
            self._release_handles,
        )
        self._assembler = PrefillResultAssembler(self.backend, self._release_handles)
        self._prompt = PromptLogprobCollector(self.backend, self._run_lm_head, self._release_handles)

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """Holds this runtime for the calling thread until the block exits (re-entrant on that thread).

        Several calls made inside are one call to every other thread: their
        entries raise ``PrefillStateError`` until the block exits, or, when a
        stream (``invocations``, ``stream``) started inside it is still
        unfinished, until that stream ends.
        """
        return self._guard.hold("hold")

    # -- model-body boundaries (shared by eager and traced paths) ---------
    # Model calls run without autograd: every public entry point that reaches
    # them (invoke, compile, capture) enters torch.inference_mode once.
    def _run_body(self, step: DeviceStep, ends_only: bool = False) -> Any:
        """The model body of ``step``; ``ends_only``: a plain packed step computes its segments' last rows alone."""
        name, args, options = body_call(step)  # the protocol method of the step's kind (steps/call_steps.py)
        if ends_only and name == "forward_packed":
            options["ends_only"] = True
        return getattr(self.config.model, name)(*args, self.config.kv, **options)

    def _run_lm_head(self, rows: Any) -> Any:
        return self.config.model.lm_head(rows)

    # -- prepare, invoke, assemble ----------------------------------------
    @exclusive
    def prepare(
        self,
        tokens,
        page_table,
        prompt_lengths: Sequence[int] | torch.Tensor,
        cached_lengths: Sequence[int] | torch.Tensor | None = None,
        slots: Sequence[int] | torch.Tensor | None = None,
        sampling: SamplingParams | Sequence[SamplingParams | None] | None = None,
        *,
        mode: ExecutionMode | str = ExecutionMode.AUTO,
        group_page_tables: Sequence | None = None,
        null_block: int | None = None,
    ) -> PreparedBatch:
        """Validates and plans a call; builds every step's host input values once.

        ``sampling`` is ``None`` (every row returns logits), one
        ``SamplingParams`` applied to every row, or a list or tuple with one
        entry (``SamplingParams`` or ``None``) per row; anything else raises a
        ``PrefillInputError`` with ``field == "sampling"``.

        Raises a ``PrefillInputError`` subclass naming the row and field on
        any malformed input; nothing is allocated or written in that case.
        ``mode``: how the call will run (``prefill_core.values.execution``), which
        decides its plan: packed steps where the config runs them and the
        call will not replay traces, else the padded waves a trace serves.
        It plans only: ``invoke`` / ``invocations`` take the mode they run in.
        ``group_page_tables``: a hybrid model's table per KV group
        (``page_table`` is group 0's, as vLLM numbers them); ``null_block``
        the caller's never-written block, which no column a step reads or
        writes may name (``prefill_core.prepare_grouped``). Hybrid calls plan
        packed steps as other calls do, where no row reads another row's
        writes (``prefill_core.prepare_grouped_packed``), else padded waves.
        """
        call = PrefillCall.of(
            tokens, page_table, prompt_lengths, cached_lengths, slots, sampling, mode,
            group_page_tables=group_page_tables, null_block=null_block,
        )  # fmt: skip
        return self.prepare_call(call)

    @exclusive
    def prepare_call(self, call: PrefillCall) -> PreparedBatch:
        """``prepare`` of a normalised call (``engine.call.PrefillCall``): every entry plans through here."""
        self._check_open()
        config = self.config
        matrix, table = call.tokens, call.page_table
        batch = build_batch(
            matrix, table, call.prompt_lengths, call.cached_lengths, call.slots, call.sampling, config.layout
        )
        check_token_ids(matrix, batch, config.model.spec.vocab_size)
        groups, shared = self._group_tables(call.group_page_tables, table, len(batch))
        context = self.call_context(
            call.mode, slots_chosen=call.slots is not None, group_tables=groups, null_block=call.null_block
        )
        spans = requested_spans(batch)
        if self._shares_spans and len(batch) > 1:  # rows that begin alike compute those positions once
            agreement = MatrixAgreement(matrix, batch.lengths)
            context = attrs.evolve(context, agreement=agreement, read_from=_read_from(spans, call.pooling))
        plan = plan_call(batch, attrs.evolve(context, groups_share_blocks=shared))
        requests, steps = plan.prepared, call_steps(plan, matrix, table, config.model.spec.hidden_size)
        prompt = tuple(prompt_steps(matrix, spans, p.request, s) for p, s in zip(requests, steps)) if spans else ()
        pooled = None if call.pooling is None else pooled_states(requests, steps, call.pooling, len(batch))
        return PreparedBatch(requests, steps, len(batch), self, config.layout, prompt, plan=plan, pooled=pooled)

    @exclusive
    def invoke(
        self,
        batch: PreparedBatch,
        index: int,
        *,
        mode: ExecutionMode | str = ExecutionMode.AUTO,
        progress: ProgressCounter | None = None,
    ) -> InvocationResult:
        """Runs request ``index`` of ``batch``: eagerly, or by replaying its captured trace.

        ``mode``: ``"traced"`` never falls back to
        eager (a request without a trace or workspace raises
        ``TraceCoverageError`` before anything runs); ``"auto"`` replays
        when the request has a trace, else runs it eagerly.
        ``progress`` counts each body step as it finishes. An error raised
        once a step has started carries ``partial_writes`` (see
        ``partial_writes.note_partial_writes``).

        Lifetime: read each invocation once (``assemble`` / ``stream``), and a
        traced one before the next traced ``invoke``: its outputs live in its
        program alias's workspace, which the next replay overwrites, so
        reading an overwritten one raises ``PrefillStateError``. An
        invocation never read is released by ``cleanup()`` / ``close()``;
        reading it afterwards raises ``PrefillStateError``.
        """
        self._check_open()
        prepared = checked_request(batch, index, self, self.config.layout)
        mode = execution_mode(mode)
        rows = prepared.request.source_rows
        finished = None
        if progress is not None:
            num_steps = len(batch.steps[index])

            def finished(step: int) -> None:
                progress.advance(f"rows {rows} chunk {step + 1}/{num_steps}")

        # A hybrid request's steps write through every KV group: its plan names them all (GroupedRequest).
        log = StepLog(getattr(batch.steps[index], "grouped", None) or prepared.request, finished)
        traced = replays(mode, self._traces.gap(prepared) is None)
        seeds = self._resolve_seeds(prepared)
        pieces = batch.prompt_steps[index] if batch.prompt_steps else None
        prompt_hook = None if pieces is None else self._prompt.hook(pieces, batch.prompt_entries)
        pool_hook = None if batch.pooled is None else batch.pooled.hook(index)
        on_hidden = _both(prompt_hook, pool_hook)
        # Prompt log-probs read every row, a pooled state may; LAST pooling reads only the segment ends.
        ends = prompt_hook is None and (pool_hook is None or batch.pooled.reads_ends_only(index))
        eager = self._eager_ends if ends else self._eager
        runner, generation = self._traces.mode_for(prepared) if traced else (eager, 0)
        try:
            with torch.inference_mode():
                signature = prepared.program_signature
                params = wave_params(prepared)
                outputs, owned = self._loop.run(runner, signature, params, batch.steps[index], seeds, on_hidden, log)
        except BaseException as error:
            if log.started:
                note_partial_writes(error, log.written_blocks(rows))
            raise
        try:  # until the assembler records it, an interrupt here would strand the outputs where cleanup() cannot
            # Rows this request returns take their entries, scored here or in earlier requests' steps (packed).
            prompt = batch.prompt_entries.take(rows) if batch.prompt_steps else None
            invocation = InvocationResult(prepared, outputs, owned, seeds, runner.workspace, generation, prompt, log)
            return self._assembler.produced(invocation)
        except BaseException as primary:
            self._release_handles(owned, primary)
            raise

    @exclusive_stream
    def invocations(
        self,
        batch: PreparedBatch,
        *,
        mode: ExecutionMode | str = ExecutionMode.AUTO,
        on_progress: ProgressCallback | None = None,
    ) -> Iterator[InvocationResult]:
        """Invocations in plan order, produced lazily (one in flight at a time).

        ``mode`` is decided for the whole call, as
        ``PrefillExecutor`` does: ``"traced"`` preflights it (a request
        without a trace raises ``TraceCoverageError`` before any request
        runs); ``"auto"`` replays only when every request has a trace. ``on_progress`` gets stage ``"prefill"``: done
        0..``batch.num_steps`` body steps (``prefill_shell.engine.progress``).

        Closing the stream early (``break``) after a packed request leaves
        the rows its steps started for a later request partly written, with
        no error to say so: the last invocation's ``unfinished_writes()``
        names their blocks (drop them from a prefix cache, as for
        ``partial_writes``).
        """
        mode = execution_mode(mode)
        gaps = self.trace_gaps(batch) if mode is not ExecutionMode.EAGER else []
        if mode is ExecutionMode.TRACED:
            require_coverage(gaps)
        run = ExecutionMode.TRACED if replays(mode, not gaps) else ExecutionMode.EAGER
        progress = ProgressCounter(on_progress, "prefill", batch.num_steps).start()
        for index in range(len(batch.requests)):
            yield self.invoke(batch, index, mode=run, progress=progress)

    @exclusive_stream
    def stream(self, invocations: Iterable[InvocationResult]) -> Iterator[PrefillResult]:
        """Each source row's result as its invocation is read and released (plan order)."""
        return self._assembler.stream(invocations)

    @exclusive
    def assemble(self, invocations: Iterable[InvocationResult], num_rows: int) -> list[PrefillResult]:
        """Reads each invocation before pulling the next; results in caller row order."""
        return self._assembler.assemble(invocations, num_rows)

    @exclusive
    def assemble_batch(self, invocations: Iterable[InvocationResult], num_rows: int) -> BatchResult:
        """``assemble`` as caller-ordered tensors (``BatchResult``): no per-row result is built."""
        return self._assembler.assemble_batch(invocations, num_rows)

    @exclusive
    def run(self, call: PrefillCall, invocations=None) -> list[PrefillResult] | BatchResult:
        """prepare + invoke + assemble of one call (``PrefillEntry.prefill`` builds it): results in caller order.

        ``invocations(batch, mode=, on_progress=)``: what streams the prepared
        call (``PrefillExecutor.invocations``: its registry and preflight);
        this runtime's own ``invocations`` by default.
        """
        return self.run_prepared(self.prepare_call(call), call, invocations)

    @exclusive
    def run_prepared(
        self, batch: PreparedBatch, call: PrefillCall, invocations=None
    ) -> list[PrefillResult] | BatchResult:
        """``run`` of a call ``prepare_call`` already planned (a caller that reads the plan first, as
        ``pooling.pooled_call`` counts the positions it computes, plans it once)."""
        if call.batched:  # refused before anything runs: a batched result has no per-row extras
            for prepared in batch.requests:
                refuse_per_row_extras(prepared.request.source_rows, prepared.request.sampling)
        if batch.pooled is not None:
            batch.pooled.start()
        stream = (invocations or self.invocations)(batch, mode=call.mode, on_progress=call.on_progress)
        if call.batched:
            return self.assemble_batch(stream, batch.num_rows)
        results = self.assemble(stream, batch.num_rows)
        return with_pooled(batch, results)  # one more kind of output: each pooled row's final hidden states

    def _group_tables(self, group_page_tables, table: torch.Tensor, rows: int) -> tuple[tuple | None, bool]:
        """Each KV group's host rows and whether the groups share one block-id space.

        A call without ``group_page_tables`` on a model with KV groups gives
        every group ``page_table`` where the pool keeps a buffer per layer
        (``KVBuffers.per_layer``: what ``new_kv_cache(num_blocks, block_size)``
        allocates), so each group's ids are its own; over vLLM's shared
        buffers one table cannot serve two groups, which is refused by name.
        """
        attention = getattr(self.config.model, "attention", None)
        if group_page_tables is not None:  # host tables already (PrefillCall)
            return tuple(tuple(map(tuple, t.tolist())) for t in group_page_tables), True
        if attention is None:
            return None, True
        buffers = getattr(self.config.kv, "buffers", None)
        sizes = {group.block_size for group in attention.groups}
        if sizes != {self.config.layout.block_size}:
            msg = (
                f"group_page_tables is invalid: the model's KV groups have block sizes {sorted(sizes)}, so one "
                f"page_table in blocks of {self.config.layout.block_size} cannot serve them; pass one table per group"
            )
            raise PrefillInputError(msg, field="group_page_tables")
        if buffers is None or buffers.shares_pages:
            msg = (
                "group_page_tables is invalid: this pool's KV groups share buffers (vLLM's plan), so each group "
                "needs its own table; pass group_page_tables and null_block, or allocate the pool with "
                "model.new_kv_cache(num_blocks, block_size) (a buffer per layer) to serve one page_table"
            )
            raise PrefillInputError(msg, field="group_page_tables")
        rows_of_table = tuple(map(tuple, table.tolist()))
        return (rows_of_table,) * len(attention.groups), False

    def call_context(
        self,
        mode: ExecutionMode | str = ExecutionMode.AUTO,
        *,
        slots_chosen: bool = True,
        group_tables=None,
        null_block: int | None = None,
    ) -> CallContext:
        """What a call's plan depends on besides its rows (``prefill_core.plan_call``): this lane as it is now."""
        config = self.config
        return CallContext(
            config.policy,
            config.layout,
            execution_mode(mode),
            config.packed_steps,
            self._traces.lane_traces(),
            slots_chosen,
            getattr(config.model, "attention", None),
            group_tables,
            null_block,
            config.model.spec.max_position,
        )

    def _resolve_seeds(self, prepared: PreparedPrefill) -> tuple[int, ...]:
        """A seed per physical row: the row's own, else one drawn from the runtime's generator.

        Only the sampling paths read seeds; logits and argmax waves get zeros
        and leave the generator untouched.
        """
        request = prepared.request
        if prepared.sampling_path not in _SEEDED_PATHS:
            return (0,) * request.padded_batch
        seeds = [
            (p.seed if p.seed is not None else self._rng.getrandbits(63)) if p is not None else 0
            for p in request.sampling
        ]
        return tuple(seeds + [seeds[0]] * (request.padded_batch - request.active_batch_size))

    # -- programs and traces ------------------------------------------------
    @exclusive
    def compile(self, signature: PrefillProgramSignature) -> None:
        """Runs ``signature``'s body and postprocessing once on a step that writes no KV.

        The normal eager path on a warm-up step; on a device this compiles
        every program the invocation uses. Its outputs are released at once.
        """
        self._check_open()
        if signature.variant is RequestKind.PACKED:
            return  # eager only and shaped by each step's segments: nothing to build ahead of a call
        step = warmup_step(signature.body, self.config.model.spec.hidden_size)
        params = _warmup_params(signature)
        with torch.inference_mode():
            _, owned = self._loop.run(self._eager, signature, params, [step], (0,) * len(params))
        self._release_handles(owned)

    @exclusive
    def allocate_workspace(self, signature: PrefillProgramSignature) -> None:
        """Allocates the persistent postprocessing workspace of one program alias."""
        self._check_open()
        self._traces.allocate_workspace(signature)

    @exclusive
    def capture(self, body: PrefillTraceSignature) -> None:
        """Captures the hidden-body trace of ``body`` with its persistent inputs."""
        self._check_open()
        with torch.inference_mode():
            self._traces.capture(body)

    @exclusive
    def trace_gap(self, prepared: PreparedPrefill) -> str | None:
        """Why ``prepared`` cannot run traced (no trace, no workspace, not eligible), or None."""
        return self._traces.gap(prepared)

    @exclusive
    def trace_gaps(self, batch: PreparedBatch) -> list[tuple[PreparedPrefill, str]]:
        """Each request of ``batch`` that cannot run traced, with ``trace_gap``'s reason, in plan order."""
        check_runnable(batch, self, self.config.layout)
        gaps = [(prepared, self._traces.gap(prepared)) for prepared in batch.requests]
        return [(prepared, why) for prepared, why in gaps if why is not None]

    @exclusive
    def captured_traces(self) -> tuple[CapturedTrace, ...]:
        """Every live captured trace (signature, persistent inputs, replay count), in capture order."""
        return tuple(self._traces.traces.values())

    @exclusive
    def release_traces(self) -> None:
        """Releases every trace and workspace (``CleanupError`` names traces that would not go)."""
        self._traces.release_all()

    @exclusive
    def configure_page_table_layout(self, layout: PageTableLayout) -> None:
        """Installs a bounded replacement layout; collaborators are not rebuilt."""
        self._check_open()
        self.config = self.config.with_layout(layout)

    # -- ownership ------------------------------------------------------
    @exclusive
    def release(self, handles: Iterable[DeviceTensor], primary: BaseException | None = None) -> None:
        """Releases live ``handles``; a failed release becomes an orphan for ``cleanup``.

        With ``primary`` (an error in flight) each cleanup failure is attached
        to it as a note; the primary error itself is never replaced. An
        interrupt (any ``BaseException`` that is not an ``Exception``, such as
        ``KeyboardInterrupt``) during a release orphans that handle and every
        one not yet released, then propagates: nothing is left unowned.
        """
        self._release_handles(handles, primary)

    def _release_handles(self, handles: Iterable[DeviceTensor], primary: BaseException | None = None) -> None:
        """``release`` for the collaborators, which run inside a call that already holds the guard."""
        pending = [h for h in handles if not h.released]
        for position, handle in enumerate(pending):
            try:
                self.backend.release(handle)
            except Exception as failure:
                self.orphans.append(handle)
                if primary is not None:
                    add_note(primary, f"cleanup: releasing {handle!r} failed: {failure!r}")
            except BaseException:
                self.orphans.extend(h for h in pending[position:] if not h.released)
                raise

    @exclusive
    def cleanup(self) -> None:
        """Releases every invocation nobody read, then retries every orphan.

        Raises ``CleanupError`` with what is still alive.
        """
        self._assembler.release_pending()
        pending, self.orphans = self.orphans, []
        failures = []
        for position, handle in enumerate(pending):
            if handle.released:
                continue
            try:
                self.backend.release(handle)
            except Exception as failure:
                self.orphans.append(handle)
                failures.append(repr(failure))
            except BaseException:
                self.orphans.extend(h for h in pending[position:] if not h.released)
                raise
        if self.orphans:
            raise CleanupError(f"{len(self.orphans)} device tensors could not be released: {failures}", self.orphans)

    @exclusive
    def close(self) -> None:
        """Releases traces, workspaces and orphans, then refuses further calls."""
        self._closed = True
        try:
            self.release_traces()
        finally:
            self.cleanup()

    def _check_open(self) -> None:
        if self._closed:
            raise PrefillStateError("this PrefillRuntime was closed; build a new one")


def _read_from(spans: dict, pooling: Sequence | None) -> dict[int, int]:
    """Per row, the first position whose hidden state a hook reads: its prompt log-probs' first position, 0
    for MEAN or CLS pooling (``PoolingType.reads_every_position``); rows read at their last token only are
    absent (the planner's ``read_from``)."""
    read_from = {row: span.start for row, span in spans.items()}
    for row, kind in enumerate(pooling or ()):
        if isinstance(kind, PoolingType) and kind.reads_every_position:
            read_from[row] = 0
    return read_from


def _both(first: Callable[[Any, int], None] | None, second: Callable[[Any, int], None] | None):
    """One step-loop hook calling ``first`` then ``second`` (either may be None)."""
    if first is None or second is None:
        return first or second

    def on_hidden(hidden: Any, step: int) -> None:
        first(hidden, step)
        second(hidden, step)

    return on_hidden
