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

1. **Who may share.** A row whose cached prefix is block aligned and that
   owes positions (``cached < length``). Rows share only with rows of the same
   cached length and the same blocks for ``[0, cached)``: their cached K/V is
   one memory.
2. **Whose K/V.** A row takes position ``p`` from the earliest row before it
   whose tokens agree with its own on ``[cached, p]``. That row computes
   ``p`` itself: a row before it agreeing on ``[cached, p]`` would agree with
   the taker too, and would be earlier.
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


def _sharing_key(batch: PrefillBatch, row: int, block_size: int) -> tuple | None:
    """Rows with equal keys read one cached K/V (rule 1); None: the row shares with none."""
    cached, length = batch.cached[row], batch.lengths[row]
    if cached >= length or cached % block_size:
        return None
    return cached, tuple(batch.blocks[row][: cached // block_size])


def shared_runs(
    batch: PrefillBatch,
    rows: Sequence[int],
    block_size: int,
    agreement: TokenAgreement,
    read_from: Mapping[int, int] | None = None,
) -> dict[int, tuple[SharedRun, ...]]:
    """Per row of ``rows`` (pack order) that takes any positions from earlier rows, its runs in position order
    (rules 1-3); they tile ``[cached, first)``, where the row's own computation starts.

    ``read_from``: per row, the first position whose hidden state a hook reads (none: only its last token's).
    """
    read_from = read_from or {}
    earlier: dict[tuple, list[int]] = {}
    runs: dict[int, tuple[SharedRun, ...]] = {}
    for row in rows:
        key = _sharing_key(batch, row, block_size)
        if key is None:
            continue
        before = earlier.setdefault(key, [])
        cached, length = key[0], batch.lengths[row]
        limit = min(length - 1, read_from.get(row, length))
        if before and limit > cached:
            agreed = agreement.agreement(row, tuple(before), cached)
            found, covered = [], cached
            for source, count in zip(before, agreed):  # rule 2: the earliest row agreeing past ``covered``
                reach = min(cached + int(count), limit)
                if reach > covered:
                    found.append(SharedRun(source, covered, reach))
                    covered = reach
            if found:
                runs[row] = tuple(found)
        before.append(row)
    return runs
