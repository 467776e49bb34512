"""The caller's batch, stored by column: one entry per prompt, in the caller's order.

A batch carries geometry only (lengths, cached offsets, slots, page-table
rows) and sampling parameters, never token contents: the shell owns tokens,
the core owns geometry.

Why columns: a serving engine hands the runtime columns (a lengths vector,
a slots vector, a page-table matrix), and most rules read one column at a
time. ``PrefillRow`` remains the one-prompt view, for callers that think in
rows. The rules themselves live in ``rules.RULES`` (stage ``batch``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from prefill_core.inputs.rules import Scope, check
from prefill_core.values.errors import PrefillInputError
from prefill_core.values.sampling import SamplingParams

__all__ = ["PrefillRow", "PrefillBatch"]


@attrs.frozen
class PrefillRow:
    """One prompt.

    ``length`` tokens, of which the first ``cached`` already sit in the KV
    cache; ``slot`` is the row's KV slot (its user id in the lane);
    ``blocks`` is the caller's page-table row: entry j is the KV block holding
    positions ``[j*block_size, (j+1)*block_size)``. Only the mapped prefix,
    the first ``ceil(length / block_size)`` entries, is read; a longer row's
    tail (vLLM's stale entries) is ignored, never copied to the device.
    """

    length: int
    cached: int = 0
    slot: int = 0
    blocks: tuple[int, ...] = ()
    sampling: SamplingParams | None = None


@attrs.frozen
class PrefillBatch:
    """The caller's prompts as columns, in the caller's order.

    Entry i of every column belongs to prompt i: ``lengths`` (tokens),
    ``cached`` (leading tokens already in the KV cache), ``slots`` (KV slot,
    unique per batch), ``blocks`` (the page-table row, see ``PrefillRow``)
    and ``sampling`` (``None`` asks for logits). The ``batch`` rules of
    ``rules.RULES`` are checked here; rules that need the layout or policy
    are checked by the planner.
    """

    lengths: tuple[int, ...]
    cached: tuple[int, ...]
    slots: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...] = attrs.field(repr=False)
    sampling: tuple[SamplingParams | None, ...]

    def __attrs_post_init__(self):
        check("batch", Scope(self))

    @classmethod
    def from_rows(cls, rows: Sequence[PrefillRow]) -> PrefillBatch:
        """A batch of ``rows`` (a tuple or list of ``PrefillRow``), in order."""
        if not isinstance(rows, (tuple, list)):
            raise PrefillInputError(
                f"PrefillBatch rows={type(rows).__name__} is invalid: must be a tuple or list of PrefillRow",
                field="rows",
            )
        for index, row in enumerate(rows):
            if not isinstance(row, PrefillRow):
                raise PrefillInputError(
                    f"row {index}: expected a PrefillRow, got {type(row).__name__}", row=index, field="row"
                )
        if not rows:
            return cls((), (), (), (), ())
        return cls(*zip(*((r.length, r.cached, r.slot, r.blocks, r.sampling) for r in rows)))

    def row(self, index: int) -> PrefillRow:
        return PrefillRow(
            self.lengths[index], self.cached[index], self.slots[index], self.blocks[index], self.sampling[index]
        )

    @property
    def rows(self) -> tuple[PrefillRow, ...]:
        """Every prompt as a ``PrefillRow`` (built on access)."""
        return tuple(map(PrefillRow, self.lengths, self.cached, self.slots, self.blocks, self.sampling))

    def __len__(self) -> int:
        return len(self.lengths)
