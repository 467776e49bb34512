"""Shared spans: rows of a packed call that begin with the same tokens compute those positions once.

Theory of operation
-------------------
Attention is causal, so a position's K/V depends only on the tokens up to it
and their positions. Two rows that read the same cached K/V (the same blocks,
not merely equal tokens) and hold the same tokens past it up to position
``p`` have the same K/V at every position up to ``p``. Calls that hold such
rows are common: chat rows over one system prompt whose tail does not fill a
block (a prefix cache keeps whole blocks only), vLLM's ``n > 1`` samples of
one prompt, lm-eval's choices after one context, a reranker's query before
each document. A packed plan computes each such position once, in the first
row that holds it, and writes its K/V into the other rows' slots too (a
*shared write*), instead of computing it in every row.

Rules (``shared_runs``), over the rows of one packing run in pack order
(``packed.py`` rule 2: one kind of output at a time):

1. **Who may share.** A row that owes positions (``cached < length``) may
   give its computed positions; a row whose cached prefix is also block
   aligned may take. Row ``r`` may take from an earlier row ``q`` that
   maps the same blocks for ``[0, cached_r)`` and owes from no later than
   ``cached_r``: their K/V before ``cached_r`` is one memory, whether it was
   cached before the call or ``q`` writes it in this call (a same-step
   prefix hit, ``packed.py`` rule 5, as vLLM's scheduler sends rows that
   arrive together).
2. **Whose K/V.** Row ``r`` takes position ``p`` from the earliest such row
   whose tokens agree with its own on ``[cached_r, p]``. Where that row
   itself takes ``p``, its source is ``r``'s too (the K/V are equal all
   along the chain), so every position comes from a row that computes it,
   and that row is packed before ``r``.
3. **What a row still computes.** Everything from its first position past
   the agreement on, and always its last token (its output) and every
   position whose hidden state a hook reads (``read_from``: prompt
   log-probs, MEAN or CLS pooling). So the shared positions of a row are
   ``[cached, first)`` with ``first = min(agreement, length - 1,
   read_from)``: a prefix of what it owes.
4. **When.** A shared write happens in the step where its source computes the
   position (``packed.py`` places it there). The taker is packed after its
   sources, so its first computed segment lies in that step or a later one,
   and a packed model writes a layer's shared K/V with the step's own K/V,
   before any attention of that layer reads the pool.

Token contents stay in the shell: the planner asks ``TokenAgreement`` how far
rows agree, and only for rows that rule 1 lets share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from prefill_core.inputs.batch import PrefillBatch

__all__ = ["SharedRun", "SharedWrite", "TokenAgreement", "shared_runs"]


@runtime_checkable
class TokenAgreement(Protocol):
    """How far rows' tokens agree: the one token fact the planner needs (the shell answers it from the tokens)."""

    def agreement(self, row: int, others: Sequence[int], start: int) -> Sequence[int]:
        """For each row of ``others``, how many positions from ``start`` on hold the same token in it and in
        ``row`` (counting stops at the first difference or at the end of either row)."""
        ...


@attrs.frozen
class SharedRun:
    """Positions ``[start, end)`` of a row whose K/V row ``source`` computes (rule 2)."""

    source: int
    start: int
    end: int


@attrs.frozen
class SharedWrite:
    """In one step: the K/V that row ``source`` computes at ``[start, start + length)`` also goes to ``row``'s
    slots for the same positions (a shared write, rule 4)."""

    source: int
    row: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def _resolved(runs: tuple[SharedRun, ...], row: int, start: int, end: int) -> list[SharedRun]:
    """``[start, end)`` of ``row`` by the row that computes each position: ``row``'s own ``runs`` where it
    takes them, ``row`` past them (rule 2's chain)."""
    found = [SharedRun(r.source, max(r.start, start), min(r.end, end)) for r in runs if r.start < end and start < r.end]
    first = runs[-1].end if runs else start
    if max(first, start) < end:
        found.append(SharedRun(row, max(first, start), end))
    return found


def _merged(runs: list[SharedRun]) -> tuple[SharedRun, ...]:
    """Adjacent runs of one source as one."""
    merged: list[SharedRun] = []
    for run in runs:
        if merged and merged[-1].source == run.source and merged[-1].end == run.start:
            merged[-1] = SharedRun(run.source, merged[-1].start, run.end)
        else:
            merged.append(run)
    return tuple(merged)


def shared_runs(
    batch: PrefillBatch,
    rows: Sequence[int],
    block_size: int,
    agreement: TokenAgreement,
    read_from: Mapping[int, int] | None = None,
) -> dict[int, tuple[SharedRun, ...]]:
    """Per row of ``rows`` (pack order) that takes any positions from earlier rows, its runs in position order,
    each from the row computing it (rules 1-3); they tile ``[cached, first)``, where the row's own computation
    starts.

    ``read_from``: per row, the first position whose hidden state a hook reads (none: only its last token's).
    """
    read_from = read_from or {}
    givers: list[int] = []  # earlier rows that compute positions (rule 1)
    runs: dict[int, tuple[SharedRun, ...]] = {}
    for row in rows:
        cached, length = batch.cached[row], batch.lengths[row]
        if cached >= length:
            continue  # a fully cached row re-runs its last token and writes nothing
        limit = min(length - 1, read_from.get(row, length))
        if givers and cached % block_size == 0 and limit > cached:
            width = cached // block_size
            mine = batch.blocks[row][:width]
            peers = [q for q in givers if batch.cached[q] <= cached and batch.blocks[q][:width] == mine]
            agreed = agreement.agreement(row, tuple(peers), cached) if peers else ()
            found: list[SharedRun] = []
            covered = cached
            for peer, count in zip(peers, agreed):  # rule 2: the earliest peer agreeing past ``covered``
                reach = min(cached + int(count), limit)
                if reach > covered:
                    found += _resolved(runs.get(peer, ()), peer, covered, reach)
                    covered = reach
            if found:
                runs[row] = _merged(found)
        givers.append(row)
    return runs
