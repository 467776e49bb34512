"""Page-table views: what a device table holds, described without copying blocks.

Three roles, intentionally different (tt-metal's paged kernels read them
differently):

* ``REGULAR``: a regular prefill's table. Column j is the row's block j for
  the row's real blocks; every other entry, and every entry of a padding
  row, is ``-1`` so the paged fill skips it (no KV write).
* ``CHUNKED_FULL``: the full-request table chunked attention reads. Column j
  is the row's absolute block j; unmapped columns hold a non-negative
  ``filler`` because the attention kernel dereferences every entry.
* ``FILL_ONLY``: a chunk's write table, chunk-relative. Column j is the
  row's block ``chunk.first_block + j`` for exactly the blocks that chunk
  writes, ``-1`` elsewhere (beyond the mapped prefix, and everywhere for a
  read-only re-run). Being chunk-relative, every full chunk of a request
  shares one view value.

``materialize_table`` turns a view plus the caller's page-table rows into the
exact integers a device gets; property tests check invariants on that.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["TableRole", "PageTableView", "materialize_table", "SKIP"]

SKIP = -1
"""Page-table entry that the paged KV fill skips."""


class TableRole(enum.Enum):
    REGULAR = "regular"
    CHUNKED_FULL = "chunked_full"
    FILL_ONLY = "fill_only"


def _check_view(view: PageTableView) -> None:
    if view.width <= 0:
        raise ValueError(f"PageTableView.width={view.width!r} must be > 0")
    if view.real_blocks and (min(view.real_blocks) < 0 or max(view.real_blocks) > view.width):
        raise ValueError(f"PageTableView.real_blocks={view.real_blocks!r} must lie in [0, width={view.width}]")
    if (view.role is TableRole.CHUNKED_FULL) != (view.filler >= 0):
        raise ValueError(f"PageTableView.filler={view.filler!r} must be >= 0 exactly when role is chunked_full")


@attrs.frozen
class PageTableView:
    """One device page table as a description.

    ``real_blocks[i]`` is how many leading columns of physical row i carry
    that row's real blocks (0 for a padding row); the rest hold ``filler``.
    """

    role: TableRole
    width: int
    real_blocks: tuple[int, ...]
    filler: int = SKIP

    def __attrs_post_init__(self):
        _check_view(self)

    @property
    def num_rows(self) -> int:
        return len(self.real_blocks)


def materialize_table(
    view: PageTableView, blocks: tuple[tuple[int, ...], ...], first_block: int = 0
) -> tuple[tuple[int, ...], ...]:
    """The exact ``[num_rows, width]`` integer table for ``view``.

    ``blocks[i]`` is the caller's page-table row of active row i; physical
    rows past ``len(blocks)`` are padding rows. ``first_block`` is the
    logical block of column 0 (a chunk's ``first_block`` for a fill-only
    table, 0 otherwise).
    """
    table = []
    first, width, filler = first_block, view.width, view.filler
    for i, real in enumerate(view.real_blocks):
        mapped = blocks[i][first : first + real] if real else ()
        table.append(tuple(mapped) + (filler,) * (width - real))
    return tuple(table)
