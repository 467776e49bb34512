"""``PrefillRuntime``: the facade that composes the collaborators around one config.

prepare (caller tensors -> prepared requests + host step values, once)
  -> invoke each prepared request (eager sequence runner or trace replay)
  -> assemble (stream: read, restore source rows, release)
  -> cleanup (retry failed releases, release traces)
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch

from prefill_core import PageTableLayout, PreparedPrefill, SamplingPath, prepare_prefill
from prefill_core.errors import CleanupError, PrefillStateError

from .batch_builder import as_token_matrix, build_batch, check_token_ids, host_page_table
from .config import PrefillRuntimeConfig
from .inputs import DeviceStep, HostStep, PrefillInputStager, build_host_steps
from .ledger import DeviceTensor
from .notes import add_note
from .postprocess import PrefillPostprocessor
from .result import InvocationResult, PrefillResult
from .assembler import PrefillResultAssembler
from .sequence_runner import PrefillSequenceRunner

__all__ = ["PrefillRuntime", "PreparedBatch"]

_SEEDED_PATHS = (SamplingPath.TOPK, SamplingPath.HOST)


@attrs.frozen(eq=False)
class PreparedBatch:
    """One prepared call: its requests in plan order and their host step values."""

    prepared: tuple[PreparedPrefill, ...]
    steps: tuple[tuple[HostStep, ...], ...]
    num_rows: int


def _inference_mode():
    """``torch.inference_mode()``, or a no-op when already inside it (entering costs ~4 us)."""
    return contextlib.nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode()


class PrefillRuntime:
    """Plans, runs and collects prefill for one execution lane."""

    def __init__(self, config: PrefillRuntimeConfig, *, seed: int = 0):
        self.config = config
        self.backend = config.backend
        self.orphans: list[DeviceTensor] = []
        self.timings: dict[str, float] = {}
        self._rng = random.Random(seed)
        self._closed = False
        self.stager = PrefillInputStager(self.backend)
        self.postprocessor = PrefillPostprocessor(self.backend, self.run_lm_head, config.policy.max_logprobs)
        self.runner = PrefillSequenceRunner(self.backend, self.stager, self.postprocessor, self.run_body, self.release)
        self.assembler = PrefillResultAssembler(self.backend, self.release)

    # -- model-body boundaries (shared by eager and traced paths) ---------
    def run_body(self, step: DeviceStep) -> Any:
        """One model-body step on staged inputs: the boundary eager and traced paths share."""
        read = None if step.read_table is None else step.read_table.value
        with _inference_mode():
            return self.config.model.forward_hidden(
                step.tokens.value, step.start.value, step.fill_table.value, read, self.config.kv
            )

    def run_lm_head(self, rows: Any) -> Any:
        """The LM head on last-token rows (the postprocessor calls it)."""
        with _inference_mode():
            return self.config.model.lm_head(rows)

    # -- public API -----------------------------------------------------
    def prepare(
        self,
        tokens,
        page_table: torch.Tensor,
        prompt_lengths: Sequence[int] | torch.Tensor,
        cached_lengths: Sequence[int] | torch.Tensor | None = None,
        slots: Sequence[int] | torch.Tensor | None = None,
        sampling: Sequence[Any] | None = None,
    ) -> PreparedBatch:
        """Validates and plans a call; builds every step's host input values once.

        Raises a ``PrefillInputError`` subclass naming the row and field on
        any malformed input; nothing is allocated or written in that case.
        """
        self._check_open()
        matrix = as_token_matrix(tokens)
        layout = self.config.layout
        table = host_page_table(page_table, matrix.shape[0])
        batch = build_batch(matrix, table, prompt_lengths, cached_lengths, slots, sampling, layout)
        check_token_ids(matrix, batch, self.config.model.spec.vocab_size)
        prepared = prepare_prefill(batch, self.config.policy, layout)
        steps = tuple(tuple(build_host_steps(matrix, p.request, table)) for p in prepared)
        return PreparedBatch(prepared, steps, len(batch))

    def invoke(self, batch: PreparedBatch, index: int) -> InvocationResult:
        """Runs request ``index`` of ``batch`` eagerly."""
        self._check_open()
        prepared = batch.prepared[index]
        with torch.inference_mode():  # entered once here; the model boundaries then skip it
            return self.runner.run(prepared, list(batch.steps[index]), self.resolve_seeds(prepared))

    def invocations(self, batch: PreparedBatch) -> Iterator[InvocationResult]:
        """Eager invocations in plan order, produced lazily (one in flight at a time)."""
        for index in range(len(batch.prepared)):
            yield self.invoke(batch, index)

    def assemble(self, invocations: Iterable[InvocationResult], num_rows: int) -> list[PrefillResult]:
        """Reads each invocation before pulling the next; results in caller row order."""
        return self.assembler.assemble(invocations, num_rows)

    def prefill(self, tokens, page_table, prompt_lengths, cached_lengths=None, slots=None, sampling=None) -> list[PrefillResult]:
        """prepare + eager invoke + assemble, with per-phase timings in ``self.timings``."""
        t0 = time.perf_counter()
        batch = self.prepare(tokens, page_table, prompt_lengths, cached_lengths, slots, sampling)
        t1 = time.perf_counter()
        results = self.assemble(self.invocations(batch), batch.num_rows)
        t2 = time.perf_counter()
        self.timings = {"prepare": t1 - t0, "invoke+assemble": t2 - t1}
        return results

    def resolve_seeds(self, prepared: PreparedPrefill) -> tuple[int, ...]:
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

    def configure_page_table_layout(self, layout: PageTableLayout) -> None:
        """Installs a bounded replacement layout; collaborators are not rebuilt."""
        self._check_open()
        self.config = self.config.with_layout(layout)

    # -- ownership ------------------------------------------------------
    def release(self, handles: Iterable[DeviceTensor], primary: BaseException | None = None) -> None:
        """Releases live ``handles``; a failed release becomes an orphan for ``cleanup``.

        With ``primary`` (an error in flight) each cleanup failure is attached
        to it as a note; the primary error itself is never replaced.
        """
        for handle in handles:
            if handle.released:
                continue
            try:
                self.backend.release(handle)
            except Exception as failure:  # noqa: BLE001 (kept as orphan, reported below)
                self.orphans.append(handle)
                if primary is not None:
                    add_note(primary, f"cleanup: releasing {handle!r} failed: {failure!r}")

    def cleanup(self) -> None:
        """Retries every orphan; raises ``CleanupError`` with what is still alive."""
        pending, self.orphans = self.orphans, []
        failures = []
        for handle in pending:
            if handle.released:
                continue
            try:
                self.backend.release(handle)
            except Exception as failure:  # noqa: BLE001
                self.orphans.append(handle)
                failures.append(repr(failure))
        if self.orphans:
            raise CleanupError(f"{len(self.orphans)} device tensors could not be released: {failures}", self.orphans)

    def close(self) -> None:
        """``cleanup`` and refuse further calls."""
        self.cleanup()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise PrefillStateError("this PrefillRuntime was closed; build a new one")
