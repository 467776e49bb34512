"""``PrefillResultAssembler``: streaming readback in the caller's row order.

For each invocation, in stream order: one synchronized read of every output,
host-side sampling for ``host``-path rows, then release of that invocation's
transients, and only then is the next invocation pulled from the stream.
Streaming is what makes trace replay safe: a replay may overwrite a shared
output buffer, so a result must be a host copy before the generator advances.

The assembler also keeps every invocation the runtime produced and nobody
has read yet (``pending``): ``release_pending`` releases them for the
runtime's ``cleanup()`` / ``close()``, so an invocation dropped unread (a
stream abandoned after one step) leaks nothing, and reading it afterwards is
a named ``PrefillStateError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from prefill_core import PreparedPrefill, SamplingPath
from prefill_core.values.errors import PrefillInputError, PrefillStateError
from prefill_core.values.sampling import refuse_per_row_extras
from prefill_shell.backends.base import Backend
from prefill_shell.device.contract import LOGITS, SAMPLED_TOKENS, TOKEN_LOGPROB, TOP_IDS, TOP_LOGPROBS, TensorSpec
from prefill_shell.engine.result import (
    BatchResult,
    InvocationResult,
    InvocationState,
    PrefillResult,
)
from prefill_shell.engine.steps.partial_writes import note_partial_writes
from prefill_shell.sampling.torch_sampling import sample_row, top_logprobs

__all__ = ["PrefillResultAssembler"]


class PrefillResultAssembler:
    """Reads, normalizes and releases invocation results one at a time."""

    def __init__(self, backend: Backend, release: Callable[..., None]):
        self.backend = backend
        self._release = release
        self.pending: dict[InvocationResult, None] = {}  # insertion-ordered: releases run in production order

    def produced(self, invocation: InvocationResult) -> InvocationResult:
        """Records a new invocation as unread until it is assembled or released; returns it."""
        self.pending[invocation] = None
        return invocation

    def release_pending(self) -> None:
        """Releases every unread invocation's tensors; reading one afterwards raises ``PrefillStateError``."""
        pending, self.pending = list(self.pending), {}
        for invocation in pending:
            invocation.state = InvocationState.RELEASED
        # One release call: an interrupt in it orphans every handle not yet released.
        self._release([handle for invocation in pending for handle in invocation.owned])

    def stream(self, invocations: Iterable[InvocationResult], num_rows: int | None = None) -> Iterator[PrefillResult]:
        """Yields each source row's result as its invocation is read (plan order).

        With ``num_rows``, an invocation holding a row outside ``[0, num_rows)``
        raises ``PrefillInputError`` before it is read (it stays unread).
        """
        for invocation in _each(invocations):
            self._check_collectable(invocation, num_rows)
            yield from self._collect_one(invocation)

    def assemble(self, invocations: Iterable[InvocationResult], num_rows: int) -> list[PrefillResult]:
        """Every row's result, in the caller's row order."""
        _check_num_rows(num_rows)
        results: dict[int, PrefillResult] = {}
        for result in self.stream(invocations, num_rows):
            results[result.row] = result
        _require_every_row([row for row in range(num_rows) if row not in results])
        return [results[row] for row in range(num_rows)]

    def assemble_batch(self, invocations: Iterable[InvocationResult], num_rows: int) -> BatchResult:
        """Every row's outputs written straight into caller-ordered tensors: ``assemble`` as one ``BatchResult``.

        The same checks, read-then-release order, bookkeeping and errors as
        ``assemble``; an invocation holding a row that asks top or prompt
        log-probs raises ``InvalidSamplingError`` before it is read.
        """
        _check_num_rows(num_rows)
        writer = _BatchWriter(num_rows)
        for invocation in _each(invocations):
            self._check_collectable(invocation, num_rows)
            request = invocation.prepared.request
            refuse_per_row_extras(request.source_rows, request.sampling)
            writer.put(invocation.prepared, self._read(invocation))
        return writer.result()

    def _check_collectable(self, invocation: InvocationResult, num_rows: int | None) -> None:
        """Refuses, before anything is read, what is not an unread invocation of this runtime for this call."""
        if not isinstance(invocation, InvocationResult):
            raise PrefillInputError(
                f"invocations: {invocation!r} is not an InvocationResult (what invoke() and invocations() produce)",
                field="invocations",
            )
        invocation.check_readable()
        if invocation not in self.pending:
            raise PrefillStateError(
                f"the invocation of rows {invocation.prepared.request.source_rows} was produced by another "
                "PrefillRuntime; assemble it on that one"
            )
        rows = invocation.prepared.request.source_rows
        if num_rows is not None and max(rows) >= num_rows:
            raise PrefillInputError(
                f"assemble: num_rows={num_rows} is invalid: the invocation holds caller rows {rows}; pass the "
                "PreparedBatch's num_rows (the invocation was not read)",
                field="num_rows",
            )

    def _collect_one(self, invocation: InvocationResult) -> list[PrefillResult]:
        results = self._normalize(invocation, self._read(invocation))
        if invocation.prompt is None:
            return results
        return [r._replace(prompt_logprobs=invocation.prompt.get(r.row, ())) for r in results]

    def _read(self, invocation: InvocationResult) -> dict[TensorSpec, torch.Tensor]:
        """``_read_outputs``; an error there stops the call before the next request runs, so the rows this
        request's packed steps started for a later request stay partly written: they ride on it as
        ``partial_writes`` (``partial_writes.note_partial_writes``)."""
        try:
            return self._read_outputs(invocation)
        except BaseException as error:
            unfinished = invocation.unfinished_writes()
            if unfinished:
                note_partial_writes(error, unfinished)
            raise

    def _read_outputs(self, invocation: InvocationResult) -> dict[TensorSpec, torch.Tensor]:
        """One synchronized read of every output, then the release; ``host``-path rows are sampled here."""
        try:  # from the moment it leaves ``pending``, only this release can reach its outputs
            self.pending.pop(invocation, None)
            invocation.state = InvocationState.ASSEMBLED
            specs = list(invocation.outputs)
            host = dict(zip(specs, self.backend.read([invocation.outputs[s] for s in specs])))
        except BaseException as primary:
            # Release failures ride on the read error as notes, never replace it.
            self._release(invocation.owned, primary=primary)
            raise
        self._release(invocation.owned)
        if invocation.prepared.sampling_path is SamplingPath.HOST:
            return self._sample_on_host(invocation, host[LOGITS])
        return host

    def _normalize(self, invocation: InvocationResult, host: dict[TensorSpec, torch.Tensor]) -> list[PrefillResult]:
        request = invocation.prepared.request
        if invocation.prepared.sampling_path is SamplingPath.LOGITS:
            rows = zip(request.source_rows, host[LOGITS].unbind(0))
            return [PrefillResult(row=row, logits=logits) for row, logits in rows]
        tokens, token_lp = host[SAMPLED_TOKENS].tolist(), host[TOKEN_LOGPROB].tolist()
        if TOP_IDS not in host:  # no row of the wave asked for top log-probs
            rows = zip(request.source_rows, tokens, token_lp)
            return [PrefillResult(row=row, token=token, logprob=logprob) for row, token, logprob in rows]
        top_ids, top_values = host[TOP_IDS].tolist(), host[TOP_LOGPROBS].tolist()
        results = []
        for b, row in enumerate(request.source_rows):
            n = request.sampling[b].num_logprobs
            top = tuple(zip(top_ids[b][:n], top_values[b][:n])) if n else ()
            results.append(PrefillResult(row=row, token=tokens[b], logprob=token_lp[b], top_logprobs=top))
        return results

    @staticmethod
    def _sample_on_host(invocation: InvocationResult, logits: torch.Tensor) -> dict[TensorSpec, torch.Tensor]:
        """The ``host`` path: device returned logits; sample here with each row's seed."""
        request = invocation.prepared.request
        active = logits[: request.active_batch_size]
        tokens = torch.stack(
            [
                sample_row(active[b], p.top_k, p.top_p, p.temperature, invocation.seeds[b])
                for b, p in enumerate(request.sampling)
            ]
        )
        top_n = max(p.num_logprobs for p in request.sampling)
        token_lp, ids, values = top_logprobs(active, tokens, top_n)
        host = {SAMPLED_TOKENS: tokens, TOKEN_LOGPROB: token_lp}
        if ids is not None:
            host.update({TOP_IDS: ids, TOP_LOGPROBS: values})
        return host


def _each(invocations: object) -> Iterator[InvocationResult]:
    """An iterator over ``invocations``; what cannot be iterated (None, one invocation) is named."""
    if isinstance(invocations, InvocationResult) or not hasattr(invocations, "__iter__"):
        raise PrefillInputError(
            f"invocations={type(invocations).__name__} is invalid: must be an iterable of InvocationResult "
            "(a list of invoke() results, or invocations())",
            field="invocations",
        )
    return iter(invocations)


def _check_num_rows(num_rows: object) -> None:
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
        raise PrefillInputError(
            f"assemble: num_rows={num_rows!r} is invalid: must be the call's row count, an int >= 1 "
            "(PreparedBatch.num_rows)",
            field="num_rows",
        )


def _require_every_row(missing: list[int]) -> None:
    if missing:
        raise PrefillStateError(f"no result was produced for rows {missing}")


def _active(values: torch.Tensor, count: int) -> torch.Tensor:
    """An output's active rows (a padded wave's padding rows follow them)."""
    return values if values.shape[0] == count else values[:count]


class _BatchWriter:
    """A call's caller-ordered output tensors, filled invocation by invocation (``assemble_batch``).

    Every row is returned by one invocation. A column an invocation fills
    whole, in caller order, is that read's own host copy; otherwise rows are
    copied in, and a row that returned nothing there holds -1 (tokens) or NaN.
    """

    def __init__(self, num_rows: int):
        self.every_row = tuple(range(num_rows))
        self.returned: set[int] = set()
        self.tokens: torch.Tensor | None = None
        self.logprobs: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def put(self, prepared: PreparedPrefill, host: dict[TensorSpec, torch.Tensor]) -> None:
        rows = prepared.request.source_rows
        count = len(rows)
        # Reads return the contract's host dtypes: int64 tokens, float32 log-probs and logits.
        if prepared.sampling_path is SamplingPath.LOGITS:
            self.logits = self._placed(self.logits, rows, _active(host[LOGITS], count), float("nan"))
        else:
            self.tokens = self._placed(self.tokens, rows, _active(host[SAMPLED_TOKENS], count), -1)
            self.logprobs = self._placed(self.logprobs, rows, _active(host[TOKEN_LOGPROB], count), float("nan"))
        self.returned.update(rows)

    def _placed(self, column: torch.Tensor | None, rows: tuple[int, ...], values: torch.Tensor, fill) -> torch.Tensor:
        if column is None and rows == self.every_row:
            return values
        if column is None:
            column = torch.full((len(self.every_row), *values.shape[1:]), fill, dtype=values.dtype)
        return column.index_copy_(0, torch.tensor(rows), values)

    def result(self) -> BatchResult:
        num_rows = len(self.every_row)
        if len(self.returned) < num_rows:
            _require_every_row([row for row in self.every_row if row not in self.returned])
        tokens = torch.full((num_rows,), -1, dtype=torch.int64) if self.tokens is None else self.tokens
        logprobs = (
            torch.full((num_rows,), float("nan"), dtype=torch.float32) if self.logprobs is None else self.logprobs
        )
        return BatchResult(tokens, logprobs, self.logits)
