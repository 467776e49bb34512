"""Prompt log-probs: the log-probs of a row's own prompt tokens, over the range the row asked for.

A row asks with ``SamplingParams.prompt_logprobs`` (``n``: each scored
token's log-prob and the ``n`` most likely alternatives) over positions
``[prompt_start, length - 1)`` (``prompt_start`` defaults to the row's cached
offset): position ``p`` scores token ``p + 1``. The range is the request's,
not the step geometry's: every requested position lies in exactly one step
(the steps compute ``[cached, length)``), wherever the chunks fall.

Two parts:

* ``prompt_steps`` (at prepare time, on the host): for each step of a
  request, which rows of the step's hidden output hold a requested position
  and which token each predicts, cut into pieces of at most
  ``POSITIONS_PER_CALL``. The step kind decides the row: ``b*S + i`` on a
  padded step (physical row ``b``, position ``i`` of the chunk), the
  segment's offset plus the position within it on a packed step (the hidden
  output holds one row per packed token).
* ``PromptLogprobCollector`` (in the step loop, after each body step, eager
  or traced): per piece, gather those rows of the step's hidden output, run
  the LM head and the log-softmax on them, read the piece back and release
  it. Memory stays bounded: never more than one piece's ``[P, V]`` logits,
  however long the prompt. Entries are kept by caller row and position
  until the request that returns the row hands them over
  (``PromptEntries``): a packed row may be scored in steps of an earlier
  request than the one its last token ends.

The last-token output is not touched: it is the postprocessor's, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from prefill_core import PackedRequest, PrefillBatch, PrefillRequest, StepSegment
from prefill_shell.backends.base import Backend
from prefill_shell.device.contract import (
    PROMPT_HIDDEN,
    PROMPT_INDEX,
    PROMPT_LOGITS,
    PROMPT_LOGPROB,
    PROMPT_TARGETS,
    PROMPT_TOP_IDS,
    PROMPT_TOP_LOGPROBS,
)
from prefill_shell.device.ledger import DeviceTensor, Ownership
from prefill_shell.engine.steps.inputs import HostStep

__all__ = [
    "POSITIONS_PER_CALL",
    "PromptLogprob",
    "PromptLogprobCollector",
    "PromptPiece",
    "prompt_steps",
    "requested_spans",
    "PromptEntries",
]

POSITIONS_PER_CALL = 32
"""Positions one LM-head call scores: one 32-row tile, what the TTTv2 LM head takes per call.

It bounds the transient logits at ``32 x V`` float32 (6 MB for SmolLM2)."""


class PromptLogprob(NamedTuple):
    """The log-prob of one prompt token: ``token`` at absolute ``position``, and the best alternatives there."""

    position: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class PromptPiece(NamedTuple):
    """Host values of one LM-head call: hidden rows, target tokens, and whose positions they are."""

    index: torch.Tensor  # int64 [P]: row of the step's hidden output (b*S + i padded, offset + i packed)
    targets: torch.Tensor  # int64 [P]: token at position + 1
    rows: tuple[int, ...]  # caller row of each entry
    positions: tuple[int, ...]  # absolute position of each scored token (p + 1)
    top: tuple[int, ...]  # alternatives each entry's row asked for
    top_n: int  # alternatives this call computes: the most any of its entries asks for


class _Span(NamedTuple):
    """Positions ``[start, end)`` a caller row asks for, with ``top`` alternatives each."""

    start: int
    end: int
    top: int


def requested_spans(batch: PrefillBatch) -> dict[int, _Span]:
    """Per caller row that asks for prompt log-probs, its requested positions ``[start, length - 1)``."""
    spans = {}
    for row, params in enumerate(batch.sampling):
        if params is None or params.prompt_logprobs is None:
            continue
        start = batch.cached[row] if params.prompt_start is None else params.prompt_start
        spans[row] = _Span(start, batch.lengths[row] - 1, params.prompt_logprobs)
    return spans


def _step_pieces(tokens: torch.Tensor, spans: dict[int, _Span], runs: tuple[StepSegment, ...]) -> list[PromptPiece]:
    """The pieces of one step: each requested position its segments compute (``request.segments(i)``)."""
    index, targets, rows, positions, top = [], [], [], [], []
    for run in runs:
        span = spans.get(run.row)
        if span is None:
            continue
        first, end = max(span.start, run.start), min(span.end, run.start + run.length)
        if first >= end:
            continue
        index.append(torch.arange(first, end) - run.start + run.offset)
        targets.append(tokens[run.row, first + 1 : end + 1])
        rows += [run.row] * (end - first)
        positions += range(first + 1, end + 1)
        top += [span.top] * (end - first)
    if not rows:
        return []
    index, targets = torch.cat(index), torch.cat(targets).to(torch.int64)
    n = POSITIONS_PER_CALL
    return [
        PromptPiece(
            index[i : i + n].clone(),
            targets[i : i + n].clone(),
            tuple(rows[i : i + n]),
            tuple(positions[i : i + n]),
            tuple(top[i : i + n]),
            max(top[i : i + n]),
        )
        for i in range(0, len(rows), n)
    ]


def prompt_steps(
    tokens: torch.Tensor,
    spans: dict[int, _Span],
    request: PrefillRequest | PackedRequest,
    steps: Sequence[HostStep],
) -> tuple[tuple[PromptPiece, ...], ...] | None:
    """Per step of ``request``, the pieces its prompt log-probs need; None when no step has any.

    ``spans``: ``requested_spans`` of the call. On packed steps a row may be
    scored in a request that does not return it (its last token falls in a
    later request); its entries wait in the batch until that request runs.
    """
    pieces = tuple(tuple(_step_pieces(tokens, spans, request.segments(step.index))) for step in steps)
    return pieces if any(pieces) else None


class PromptLogprobCollector:
    """Scores the requested positions of each step's hidden output, one bounded piece at a time."""

    def __init__(self, backend: Backend, lm_head: Callable[[Any], Any], release: Callable[..., None]):
        self._backend = backend
        self._lm_head = lm_head
        self._release = release

    def hook(self, pieces: tuple[tuple[PromptPiece, ...], ...], into: PromptEntries):
        """The step loop's ``on_hidden(hidden, step)``: scores step ``step``'s pieces into ``into``."""

        def on_hidden(hidden: Any, step: int) -> None:
            self.collect(hidden, pieces[step], into)

        return on_hidden

    def collect(self, hidden: Any, pieces: tuple[PromptPiece, ...], into: PromptEntries) -> None:
        """Puts each scored position of ``pieces`` in ``into`` as a ``PromptLogprob`` (``PromptEntries.put``).

        Every device tensor of a piece is
        released before the next piece starts (on failure too: the primary
        error propagates, cleanup failures ride on it as notes).
        """
        for piece in pieces:
            owned: list[DeviceTensor] = []
            try:
                host = self._score(hidden, piece, owned)
            except BaseException as primary:
                self._release(owned, primary=primary)
                raise
            self._release(owned)
            _put(into, piece, host)

    def _score(self, hidden: Any, piece: PromptPiece, owned: list[DeviceTensor]) -> list[torch.Tensor]:
        backend = self._backend

        def keep(handle: DeviceTensor) -> DeviceTensor:
            owned.append(handle)
            return handle

        def adopt(value: Any, spec) -> DeviceTensor:
            return keep(backend.adopt(value, spec, Ownership.INVOCATION))

        index = keep(backend.upload(piece.index, PROMPT_INDEX, Ownership.INVOCATION))
        targets = keep(backend.upload(piece.targets, PROMPT_TARGETS, Ownership.INVOCATION))
        rows = adopt(backend.gather_positions(hidden, index.value), PROMPT_HIDDEN)  # [P, H]
        logits = adopt(self._lm_head(rows.value), PROMPT_LOGITS)  # [P, V] float32
        token_lp, top_ids, top_values = backend.logprobs(logits.value, targets.value, piece.top_n)
        outputs = [adopt(token_lp, PROMPT_LOGPROB)]
        if top_ids is not None:
            outputs += [adopt(top_ids, PROMPT_TOP_IDS), adopt(top_values, PROMPT_TOP_LOGPROBS)]
        return backend.read(outputs)


class PromptEntries:
    """Prompt log-probs one prepared call has scored, by caller row and position, until a request takes them.

    The one part of a ``PreparedBatch`` that running it changes, and why it
    exists: on packed steps a row may be scored in the steps of a request
    that does not return it (its last token falls in a later request), so
    its entries wait here until the request that returns the row runs.
    Keyed by position, so running a request again replaces its entries
    rather than adding to them.
    """

    def __init__(self) -> None:
        self._by_row: dict[int, dict[int, PromptLogprob]] = {}

    def put(self, row: int, entry: PromptLogprob) -> None:
        self._by_row.setdefault(row, {})[entry.position] = entry

    def take(self, rows: Sequence[int]) -> dict[int, tuple[PromptLogprob, ...]]:
        """Hands over the entries of caller ``rows`` (whose request just ran), in position order."""
        by_row = self._by_row
        return {row: tuple(entry for _, entry in sorted(by_row.pop(row).items())) for row in rows if row in by_row}


def _put(into: PromptEntries, piece: PromptPiece, host: list[torch.Tensor]) -> None:
    logprobs = host[0].tolist()
    ids = host[1].tolist() if len(host) > 1 else None
    values = host[2].tolist() if len(host) > 1 else None
    targets = piece.targets.tolist()
    for i, (row, position, n) in enumerate(zip(piece.rows, piece.positions, piece.top)):
        top = tuple(zip(ids[i][:n], values[i][:n])) if ids is not None else ()
        into.put(row, PromptLogprob(position, targets[i], logprobs[i], top))
