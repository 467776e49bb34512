"""Prompt log-probs: the log-probs of a row's own prompt tokens, over the range the row asked for.

A row asks with ``SamplingParams.prompt_logprobs`` (``n``: each scored
token's log-prob and the ``n`` most likely alternatives) over positions
``[prompt_start, length - 1)`` (``prompt_start`` defaults to the row's cached
offset): position ``p`` scores token ``p + 1``. The range is the request's,
not the step geometry's: every requested position lies in exactly one step
(the steps compute ``[cached, length)``), wherever the chunks fall.

Two parts:

* ``prompt_steps`` (at prepare time, on the host): for each step of a
  request, which step rows (``b*S + i``) hold a requested position and which
  token each predicts, cut into pieces of at most ``POSITIONS_PER_CALL``.
* ``PromptLogprobCollector`` (in the step loop, after each body step, eager
  or traced): per piece, gather those rows of the step's hidden output, run
  the LM head and the log-softmax on them, read the piece back and release
  it. Memory stays bounded: never more than one piece's ``[P, V]`` logits,
  however long the prompt.

The last-token output is not touched: it is the postprocessor's, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from prefill_core import PrefillRequest

from .backends.base import Backend
from .contract import (
    PROMPT_HIDDEN,
    PROMPT_INDEX,
    PROMPT_LOGITS,
    PROMPT_LOGPROB,
    PROMPT_TARGETS,
    PROMPT_TOP_IDS,
    PROMPT_TOP_LOGPROBS,
)
from .inputs import HostStep
from .ledger import DeviceTensor, Ownership

__all__ = ["POSITIONS_PER_CALL", "PromptLogprob", "PromptPiece", "PromptLogprobCollector", "prompt_steps"]

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
    """Host values of one LM-head call: step rows, target tokens, and whose positions they are."""

    index: torch.Tensor  # int64 [P]: step row b*S + i
    targets: torch.Tensor  # int64 [P]: token at position + 1
    rows: tuple[int, ...]  # physical row b of each entry
    positions: tuple[int, ...]  # absolute position of each scored token (p + 1)


def _span(request: PrefillRequest, b: int) -> tuple[int, int] | None:
    """Row ``b``'s requested positions ``[start, end)``, or None when it asks for none."""
    params = request.sampling[b]
    if params is None or params.prompt_logprobs is None:
        return None
    start = request.cached[b] if params.prompt_start is None else params.prompt_start
    return start, request.lengths[b] - 1


def _step_pieces(tokens: torch.Tensor, request: PrefillRequest, step: HostStep) -> list[PromptPiece]:
    chunk = step.chunk
    index, targets, rows, positions = [], [], [], []
    for b, source in enumerate(request.source_rows):
        span = _span(request, b)
        if span is None:
            continue
        first, end = max(span[0], chunk.start), min(span[1], chunk.end)
        if first >= end:
            continue
        index.append(torch.arange(first, end) - chunk.start + b * chunk.length)
        targets.append(tokens[source, first + 1 : end + 1])
        rows += [b] * (end - first)
        positions += range(first + 1, end + 1)
    if not rows:
        return []
    index, targets = torch.cat(index), torch.cat(targets).to(torch.int64)
    n = POSITIONS_PER_CALL
    return [
        PromptPiece(
            index[i : i + n].clone(), targets[i : i + n].clone(), tuple(rows[i : i + n]), tuple(positions[i : i + n])
        )
        for i in range(0, len(rows), n)
    ]


def prompt_steps(
    tokens: torch.Tensor, request: PrefillRequest, steps: list[HostStep]
) -> tuple[tuple[PromptPiece, ...], ...]:
    """Per step of ``request``, the pieces its prompt log-probs need (empty where none)."""
    return tuple(tuple(_step_pieces(tokens, request, step)) for step in steps)


def top_n_of(request: PrefillRequest) -> int:
    """Alternatives the request computes per position: the most any of its rows asks for."""
    return max(
        (p.prompt_logprobs for p in request.sampling if p is not None and p.prompt_logprobs is not None), default=0
    )


class PromptLogprobCollector:
    """Scores the requested positions of each step's hidden output, one bounded piece at a time."""

    def __init__(self, backend: Backend, lm_head: Callable[[Any], Any], release: Callable[..., None]):
        self._backend = backend
        self._lm_head = lm_head
        self._release = release

    def hook(self, pieces: tuple[tuple[PromptPiece, ...], ...], request: PrefillRequest):
        """(entries by physical row, filled as steps run; ``on_hidden(hidden, step)`` for the step loop)."""
        top_n, entries = top_n_of(request), {}

        def on_hidden(hidden: Any, step: int) -> None:
            self.collect(hidden, pieces[step], top_n, entries)

        return entries, on_hidden

    def collect(self, hidden: Any, pieces: tuple[PromptPiece, ...], top_n: int, into: dict[int, list]) -> None:
        """Appends each scored position of ``pieces`` to ``into[physical row]`` as a ``PromptLogprob``.

        Every device tensor of a piece is released before the next piece
        starts (on failure too: the primary error propagates, cleanup
        failures ride on it as notes).
        """
        for piece in pieces:
            owned: list[DeviceTensor] = []
            try:
                host = self._score(hidden, piece, top_n, owned)
            except BaseException as primary:
                self._release(owned, primary=primary)
                raise
            self._release(owned)
            _append(into, piece, host)

    def _score(self, hidden: Any, piece: PromptPiece, top_n: int, owned: list[DeviceTensor]) -> list[torch.Tensor]:
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
        token_lp, top_ids, top_values = backend.logprobs(logits.value, targets.value, top_n)
        outputs = [adopt(token_lp, PROMPT_LOGPROB)]
        if top_ids is not None:
            outputs += [adopt(top_ids, PROMPT_TOP_IDS), adopt(top_values, PROMPT_TOP_LOGPROBS)]
        return backend.read(outputs)


def _append(into: dict[int, list], piece: PromptPiece, host: list[torch.Tensor]) -> None:
    logprobs = host[0].tolist()
    ids = host[1].tolist() if len(host) > 1 else None
    values = host[2].tolist() if len(host) > 1 else None
    targets = piece.targets.tolist()
    for i, (b, position) in enumerate(zip(piece.rows, piece.positions)):
        top = tuple(zip(ids[i], values[i])) if ids is not None else ()
        into.setdefault(b, []).append(PromptLogprob(position, targets[i], logprobs[i], top))
