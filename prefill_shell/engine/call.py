"""``PrefillCall``: a caller's prefill, normalised once, and ``PrefillEntry``: the one ``prefill`` signature.

Every entry that runs a prefill (``PrefillRuntime``, ``PrefillExecutor``,
``LaneGroup``; the serving facades and the scorer call one of them) takes a
``PrefillCall``: tokens and page tables converted to host integer matrices
and checked once (``batch_builder``), the run mode parsed once
(``prefill_core.execution_mode``), the per-row arguments (lengths, cached
lengths, slots, sampling) kept as given until the lane that runs them builds
its ``PrefillBatch`` (a lane group routes rows first). Each entry's
``prefill(...)`` is ``PrefillEntry.prefill``: it builds the value and hands it
to the entry's ``run``, so the public signature is written once and cannot
drift between entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from prefill_core import ExecutionMode, execution_mode
from prefill_core.values.errors import PrefillInputError
from prefill_shell.engine.batch_builder import as_token_matrix, host_page_table, host_rows
from prefill_shell.engine.progress import ProgressCallback

__all__ = ["PrefillCall", "PrefillEntry"]


def _group_tables(group_page_tables, num_rows: int) -> tuple[torch.Tensor, ...] | None:
    if group_page_tables is None:
        return None
    if not isinstance(group_page_tables, (list, tuple)):
        msg = "group_page_tables is invalid: must be a list of one table per KV group"
        raise PrefillInputError(msg, field="group_page_tables")
    return tuple(host_page_table(table, num_rows) for table in group_page_tables)


@attrs.frozen(eq=False)
class PrefillCall:
    """One call as every entry takes it: host matrices checked, the mode parsed, per-row arguments as given.

    ``tokens``: int64 ``[rows, width]``; ``page_table`` and each of
    ``group_page_tables`` (a model with KV groups: one table per group, as
    vLLM numbers them): integer ``[rows, W]``. ``batched``: return
    caller-ordered tensors (``BatchResult``) instead of per-row results.
    """

    tokens: torch.Tensor
    page_table: torch.Tensor
    prompt_lengths: Any
    cached_lengths: Any = None
    slots: Any = None
    sampling: Any = None
    mode: ExecutionMode = ExecutionMode.AUTO
    on_progress: ProgressCallback | None = None
    batched: bool = False
    group_page_tables: tuple[torch.Tensor, ...] | None = None
    null_block: int | None = None
    # Per row, a ``prefill_core.values.pooling.PoolingType`` or None: the row's pooled final hidden states
    # come back as ``PrefillResult.pooled`` (``engine.steps.pooled_states``). None: no row pools.
    pooling: tuple | None = None

    @classmethod
    def of(cls, tokens, page_table, prompt_lengths, cached_lengths=None, slots=None, sampling=None,
           mode=ExecutionMode.AUTO, on_progress=None, *,
           batched=False, group_page_tables=None, null_block=None, pooling=None):  # fmt: skip
        """The caller's arguments (``PrefillEntry.prefill``'s) normalised; a ``PrefillInputError`` names the
        field on bad input."""
        parsed = execution_mode(mode)
        matrix = as_token_matrix(tokens)
        rows = int(matrix.shape[0])
        table = host_page_table(page_table, rows)
        groups = _group_tables(group_page_tables, rows)
        if pooling is not None:
            if isinstance(pooling, (str, bytes)) or not isinstance(pooling, Sequence) or len(pooling) != rows:
                msg = f"pooling={pooling!r} is invalid: one PoolingType or None per row ({rows} rows)"
                raise PrefillInputError(msg, field="pooling")
            if batched:
                msg = "pooling is invalid with batched=True: a BatchResult has no per-row pooled vectors"
                raise PrefillInputError(msg, field="pooling")
            pooling = tuple(pooling)
        return cls(
            matrix, table, prompt_lengths, cached_lengths, slots, sampling, parsed, on_progress, bool(batched), groups,
            null_block, pooling,
        )  # fmt: skip

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def for_rows(self, rows: Sequence[int], pick, slots: Sequence[int] | None) -> PrefillCall:
        """The call of ``rows`` alone (a lane's share), with ``slots``; ``pick(value, rows)`` selects the
        per-row arguments the caller gave (a lane group has already checked them)."""
        groups = None if self.group_page_tables is None else tuple(host_rows(t, rows) for t in self.group_page_tables)
        return attrs.evolve(
            self,
            tokens=host_rows(self.tokens, rows),
            page_table=host_rows(self.page_table, rows),
            prompt_lengths=pick(self.prompt_lengths, rows),
            cached_lengths=pick(self.cached_lengths, rows),
            slots=None if slots is None else list(slots),
            sampling=pick(self.sampling, rows),
            group_page_tables=groups,
            pooling=None if self.pooling is None else tuple(self.pooling[row] for row in rows),
        )


class PrefillEntry:
    """The one public ``prefill`` signature, shared by every entry; a subclass implements ``run(call)``."""

    def run(self, call: PrefillCall):  # pragma: no cover - every entry overrides it
        raise NotImplementedError

    def prefill(
        self,
        tokens,
        page_table,
        prompt_lengths,
        cached_lengths=None,
        slots=None,
        sampling=None,
        mode: ExecutionMode | str = ExecutionMode.AUTO,
        on_progress: ProgressCallback | None = None,
        *,
        batched: bool = False,
        group_page_tables: Sequence | None = None,
        null_block: int | None = None,
        pooling: Sequence | None = None,
    ):
        """Plans, runs and reads back one call: one result per caller row, in caller order.

        ``tokens`` ``[rows, width]`` (right-padded), ``page_table`` ``[rows, W]``
        (each row's KV blocks), ``prompt_lengths`` per row; optional per row:
        ``cached_lengths`` (leading tokens already in the pool, a multiple of
        the block size), ``slots`` (KV slots; without them rows are numbered
        and a call wider than a lane is served in sub-batches), ``sampling``
        (None for logits, one ``SamplingParams`` for every row, or one entry
        per row). ``mode``: ``"auto"``, ``"eager"`` or ``"traced"``
        (``prefill_core.ExecutionMode``; traced never falls back).
        ``on_progress``: body steps as they finish. ``batched=True``: the
        outputs as caller-ordered tensors (``BatchResult``). A model with KV
        groups takes ``page_table`` alone where its pool keeps a buffer per
        layer, or ``group_page_tables`` (one per group) and ``null_block`` as
        vLLM sends them. ``pooling``: one ``PoolingType`` (LAST, MEAN, CLS)
        or None per row: each such row's final hidden states pooled across its
        steps, as ``PrefillResult.pooled`` (float32 ``[hidden]``).
        """
        call = PrefillCall.of(
            tokens, page_table, prompt_lengths, cached_lengths, slots, sampling, mode, on_progress,
            batched=batched, group_page_tables=group_page_tables, null_block=null_block, pooling=pooling,
        )  # fmt: skip
        return self.run(call)
