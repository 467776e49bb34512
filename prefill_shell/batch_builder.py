"""Caller tensors -> ``PrefillBatch``, with named errors for every malformed input.

This is the runtime's input boundary: a wrong dtype, rank or shape is a
``PrefillInputError`` naming the field (and row), never a torch exception.
Only each row's mapped page-table prefix is read (``ceil(length / block)``
entries), so vLLM's stale tails never reach the plan or the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefill_core import PageTableLayout, PrefillBatch
from prefill_core.errors import PrefillInputError

__all__ = ["build_batch", "as_token_matrix", "check_token_ids", "host_page_table"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _fail(field: str, value: object, rule: str) -> PrefillInputError:
    return PrefillInputError(f"{field}={value} is invalid: {rule}", field=field)


def _int_vector(name: str, value, num_rows: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INT_DTYPES or value.dim() != 1:
            raise _fail(name, f"<tensor {value.dtype} {tuple(value.shape)}>", "must be a 1-D integer tensor")
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise _fail(name, type(value).__name__, "must be a sequence of ints or a 1-D integer tensor")
    if len(value) != num_rows:
        raise _fail(name, f"<{len(value)} values>", f"must hold one value per row ({num_rows} rows)")
    if not set(map(type, value)) <= {int}:
        row, item = next((row, item) for row, item in enumerate(value) if type(item) is not int)
        raise PrefillInputError(f"row {row}: {name}={item!r} is invalid: must be an int", row=row, field=name)
    return list(value)


def as_token_matrix(tokens) -> torch.Tensor:
    """The caller's tokens as an int64 ``[N, T]`` host tensor (rows right-padded)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype not in _INT_DTYPES or tokens.dim() != 2:
            raise _fail("tokens", f"<tensor {tokens.dtype} {tuple(tokens.shape)}>", "must be a 2-D integer tensor [rows, tokens]")
        if tokens.dtype is torch.int64 and tokens.device.type == "cpu":
            return tokens  # already the host matrix: no conversion op
        return tokens.to(device="cpu", dtype=torch.int64)
    if not isinstance(tokens, Sequence) or not tokens:
        raise _fail("tokens", type(tokens).__name__, "must be a non-empty 2-D integer tensor or a list of token lists")
    rows = []
    for row, item in enumerate(tokens):
        t = torch.as_tensor(item) if not isinstance(item, torch.Tensor) else item
        if t.dtype not in _INT_DTYPES or t.dim() != 1:
            raise PrefillInputError(f"row {row}: tokens must be a 1-D list of ints", row=row, field="tokens")
        rows.append(t.to(torch.int64))
    width = max(len(r) for r in rows)
    out = torch.zeros(len(rows), max(width, 1), dtype=torch.int64)
    for row, t in enumerate(rows):
        out[row, : len(t)] = t
    return out


def host_page_table(page_table, num_rows: int) -> torch.Tensor:
    """The caller's page table as a host tensor, checked for dtype, rank and row count."""
    if not isinstance(page_table, torch.Tensor) or page_table.dtype not in _INT_DTYPES or page_table.dim() != 2:
        shown = f"<tensor {page_table.dtype} {tuple(page_table.shape)}>" if isinstance(page_table, torch.Tensor) else type(page_table).__name__
        raise _fail("page_table", shown, "must be a 2-D integer tensor [rows, blocks]")
    if page_table.shape[0] != num_rows:
        raise _fail("page_table", f"<{page_table.shape[0]} rows>", f"must have one row per prompt ({num_rows})")
    return page_table if page_table.device.type == "cpu" else page_table.to("cpu")


def _raise_first_shape_rule(lengths: list[int], need: list[int], columns: int, table_columns: int) -> None:
    for row, length in enumerate(lengths):
        if length > columns:
            rule = f"tokens holds only {columns} columns"
            raise PrefillInputError(f"row {row}: prompt_lengths={length} is invalid: {rule}", row=row, field="prompt_lengths")
        if need[row] > table_columns:
            rule = f"the mapped prefix needs {need[row]} entries but page_table has {table_columns} columns"
            raise PrefillInputError(f"row {row}: page_table is invalid: {rule}", row=row, field="page_table")


def build_batch(
    tokens: torch.Tensor,
    table: torch.Tensor,
    prompt_lengths,
    cached_lengths,
    slots,
    sampling,
    layout: PageTableLayout,
) -> PrefillBatch:
    """A validated ``PrefillBatch`` from caller tensors.

    ``tokens`` is already the host matrix (``as_token_matrix``) and ``table``
    the checked host page table (``host_page_table``); the runtime keeps
    both for staging, so each is converted and checked once.
    """
    num_rows = tokens.shape[0]
    lengths = _int_vector("prompt_lengths", prompt_lengths, num_rows)
    cached = [0] * num_rows if cached_lengths is None else _int_vector("cached_lengths", cached_lengths, num_rows)
    slot_ids = list(range(num_rows)) if slots is None else _int_vector("slots", slots, num_rows)
    params = [None] * num_rows if sampling is None else list(sampling)
    if len(params) != num_rows:
        raise _fail("sampling", f"<{len(params)} entries>", f"must hold one entry per row ({num_rows})")
    bs, columns = layout.block_size, tokens.shape[1]
    need = [-(-length // bs) for length in lengths]  # <= 0 for a bad length, which the core names
    if num_rows and (max(lengths) > columns or max(need) > table.shape[1]):
        _raise_first_shape_rule(lengths, need, columns, table.shape[1])
    # One host conversion of the mapped columns; stale tails past each row's
    # prefix are never read. The core gets columns: no per-row objects.
    widest = max(need, default=0)
    mapped = table[:, :widest].tolist()  # an empty batch fails in the core
    if need == [widest] * num_rows:  # one mapped width (a uniform wave): the cut rows are the prefixes
        blocks = tuple(map(tuple, mapped))
    else:
        blocks = tuple(map(tuple, map(list.__getitem__, mapped, map(slice, need))))
    return PrefillBatch(tuple(lengths), tuple(cached), tuple(slot_ids), blocks, tuple(params))


def check_token_ids(tokens: torch.Tensor, batch: PrefillBatch, vocab_size: int) -> None:
    """Every prompt token (past each row's length anything goes) is in ``[0, vocab_size)``."""
    if tokens.numel() == 0:
        return
    low, high = torch.aminmax(tokens)
    if int(low) >= 0 and int(high) < vocab_size:
        return  # the whole matrix is in range: no per-row mask needed
    lengths = torch.tensor(batch.lengths).unsqueeze(1)
    inside = torch.arange(tokens.shape[1]).unsqueeze(0) < lengths  # [N, T]
    bad = inside & ((tokens < 0) | (tokens >= vocab_size))
    if bool(bad.any()):
        row, column = (int(i) for i in bad.nonzero()[0])
        value = int(tokens[row, column])
        rule = f"token ids must lie in [0, vocab_size={vocab_size})"
        raise PrefillInputError(f"row {row}: tokens[{column}]={value} is invalid: {rule}", row=row, field="tokens")
