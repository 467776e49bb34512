"""Caller tensors -> ``PrefillBatch``, with named errors for every malformed input.

This is the runtime's input boundary: a wrong dtype, rank or shape is a
``PrefillInputError`` naming the field (and row), never a torch exception.
Only each row's mapped page-table prefix is read (``ceil(length / block)``
entries), so vLLM's stale tails never reach the plan or the device.

Forms: tokens and the page table are 2-D integer tensors or sequences of
rows (each a sequence of Python ints or a 1-D integer tensor); lengths,
cached lengths and slots are 1-D integer tensors or sequences of Python
ints. Bools, floats and numpy values are refused by name. Tensor rows are
right-padded by contract; a list row may be longer than its prompt (or
mapped prefix) but never shorter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefill_core import PageTableLayout, PrefillBatch, SamplingParams
from prefill_core.values.errors import PrefillInputError
from prefill_core.values.intmath import ceil_div_column

__all__ = ["build_batch", "as_token_matrix", "check_token_ids", "host_page_table", "host_rows"]

_INT_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_LIST_WIDTHS = "_prefill_list_row_widths"
"""Attribute naming, on a matrix this module built from rows, each row's own width.

Padding makes a short list row look like a right-padded tensor row; the
widths let ``build_batch`` tell the two apart. Tensors the caller passed
never carry it, so their path pays nothing.
"""


def _fail(field: str, value: object, rule: str) -> PrefillInputError:
    return PrefillInputError(f"{field}={value} is invalid: {rule}", field=field)


def _row_fail(row: int, field: str, value: object, rule: str, *, column: int | None = None) -> PrefillInputError:
    where = field if column is None else f"{field}[{column}]"
    return PrefillInputError(f"row {row}: {where}={value} is invalid: {rule}", row=row, field=field)


def _shown(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {value.dtype} {tuple(value.shape)}>"
    return type(value).__name__


def _dense(field: str, value: torch.Tensor, row: int | None = None) -> None:
    """Refuses a tensor with no dense host-readable data (sparse, meta): torch's own errors would name nothing."""
    if value.layout is torch.strided and not value.is_meta:
        return
    rule = "must be a dense tensor holding data (not sparse, not on the meta device)"
    shown = f"<tensor {value.layout} on {value.device}>"
    raise _fail(field, shown, rule) if row is None else _row_fail(row, field, shown, rule)


def _numpy_hint(value: object) -> str:
    if type(value).__module__ != "numpy":
        return ""
    return " (convert a numpy array with torch.from_numpy, numpy ints with int())"


def _is_sequence(value: object) -> bool:
    if isinstance(value, (list, tuple)):  # the usual forms, without the ABC check
        return True
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _check_ints(row: int, field: str, values: Sequence) -> None:
    """Every item of a caller row is a Python int (bool excluded) that fits in int64."""
    if not set(map(type, values)) <= {int}:
        column, item = next((c, v) for c, v in enumerate(values) if type(v) is not int)
        raise _row_fail(row, field, repr(item), "must be an int" + _numpy_hint(item), column=column)
    if values and (min(values) < _INT64_MIN or max(values) > _INT64_MAX):
        column, item = next((c, v) for c, v in enumerate(values) if not _INT64_MIN <= v <= _INT64_MAX)
        raise _row_fail(row, field, item, "must fit in int64", column=column)


def _int_vector(name: str, value, num_rows: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INT_DTYPES or value.dim() != 1:
            raise _fail(name, _shown(value), "must be a 1-D integer tensor")
        _dense(name, value)
        if value.shape[0] != num_rows:
            raise _fail(name, f"<{value.shape[0]} values>", f"must hold one value per row ({num_rows} rows)")
        return value.tolist()  # Python ints by construction
    if not _is_sequence(value):
        raise _fail(name, _shown(value), "must be a sequence of ints or a 1-D integer tensor" + _numpy_hint(value))
    if len(value) != num_rows:
        raise _fail(name, f"<{len(value)} values>", f"must hold one value per row ({num_rows} rows)")
    if not set(map(type, value)) <= {int}:
        row, item = next((row, item) for row, item in enumerate(value) if type(item) is not int)
        raise _row_fail(row, name, repr(item), "must be an int" + _numpy_hint(item))
    return list(value)


def _caller_row(field: str, row: int, item) -> torch.Tensor | Sequence:
    """One row of a 2-D field given as rows: a 1-D integer tensor or a sequence of ints."""
    if isinstance(item, torch.Tensor):
        if item.dtype not in _INT_DTYPES or item.dim() != 1:
            raise _row_fail(row, field, _shown(item), "a row must be a 1-D integer tensor or a list of ints")
        _dense(field, item, row)
        return item
    if not _is_sequence(item):
        rule = "a row must be a list of ints or a 1-D integer tensor" + _numpy_hint(item)
        raise _row_fail(row, field, _shown(item), rule)
    _check_ints(row, field, item)
    return item


def _int_matrix(field: str, value, filler: int) -> torch.Tensor:
    """A 2-D field as a host integer matrix; rows given as a sequence are right-padded with ``filler``.

    A matrix built from rows is int64 and carries each row's own width (see
    ``_LIST_WIDTHS``); a caller tensor is returned as it is (moved to the
    host), so its path costs no conversion.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INT_DTYPES or value.dim() != 2:
            raise _fail(field, _shown(value), "must be a 2-D integer tensor [rows, columns] or a list of int lists")
        _dense(field, value)
        return value if value.is_cpu else value.to("cpu")
    if not _is_sequence(value):
        rule = "must be a 2-D integer tensor [rows, columns] or a list of int lists" + _numpy_hint(value)
        raise _fail(field, _shown(value), rule)
    rows = [_caller_row(field, row, item) for row, item in enumerate(value)]
    widths = [len(r) for r in rows]
    out = torch.full((len(rows), max(widths, default=0)), filler, dtype=torch.int64)
    for row, values in enumerate(rows):
        if widths[row]:
            out[row, : widths[row]] = torch.as_tensor(values, dtype=torch.int64)
    setattr(out, _LIST_WIDTHS, widths)
    return out


def as_token_matrix(tokens) -> torch.Tensor:
    """The caller's tokens as an int64 ``[N, T]`` host matrix (tensor rows right-padded by contract)."""
    matrix = _int_matrix("tokens", tokens, 0)
    return matrix if matrix.dtype is torch.int64 else matrix.to(torch.int64)  # staged token buffers are int64


def host_page_table(page_table, num_rows: int) -> torch.Tensor:
    """The caller's page table as a host integer matrix, checked for dtype, rank and row count.

    List rows are right-padded with ``-1`` (no block); ``build_batch`` checks
    that each one covers its row's mapped prefix.
    """
    table = _int_matrix("page_table", page_table, -1)
    if table.shape[0] != num_rows:
        raise _fail("page_table", f"<{table.shape[0]} rows>", f"must have one row per prompt ({num_rows})")
    return table


def host_rows(matrix: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Rows of a matrix ``as_token_matrix`` or ``host_page_table`` returned, as the same kind of matrix.

    A matrix built from the caller's list rows keeps each picked row's own
    width, so a runtime handed it (a lane of a ``LaneGroup``) checks the rows
    as the caller's lists without converting them a second time.
    """
    picked = matrix[list(rows)]
    widths = getattr(matrix, _LIST_WIDTHS, None)
    if widths is not None:
        setattr(picked, _LIST_WIDTHS, [widths[row] for row in rows])
    return picked


def _check_list_widths(matrix: torch.Tensor, field: str, needed: list[int], what: str) -> None:
    """Each row the caller gave as a list holds at least ``needed[row]`` entries (its prompt or mapped prefix)."""
    widths = getattr(matrix, _LIST_WIDTHS, None)
    if widths is None:
        return  # a caller tensor: rows are right-padded by contract
    for row, (width, need) in enumerate(zip(widths, needed)):
        if width < need:
            rule = f"a {field} list row must hold at least its {what} ({need} entries); it holds {width}"
            raise _row_fail(row, field, f"<list of {width}>", rule)


def _raise_first_shape_rule(lengths: list[int], need: list[int], columns: int, table_columns: int) -> None:
    for row, length in enumerate(lengths):
        if length > columns:
            rule = f"tokens holds only {columns} columns"
            raise PrefillInputError(
                f"row {row}: prompt_lengths={length} is invalid: {rule}", row=row, field="prompt_lengths"
            )
        if need[row] > table_columns:
            rule = f"the mapped prefix needs {need[row]} entries but page_table has {table_columns} columns"
            raise PrefillInputError(f"row {row}: page_table is invalid: {rule}", row=row, field="page_table")


def _row_sampling(sampling, num_rows: int) -> list:
    """Per-row sampling entries: ``None`` (logits for all), one ``SamplingParams`` for every row, or one per row."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling] * num_rows
    if not isinstance(sampling, (list, tuple)):
        rule = (
            "must be None, one SamplingParams for every row, or a list with one entry (SamplingParams or None) per row"
        )
        shown = _shown(sampling) if isinstance(sampling, torch.Tensor) else repr(sampling)[:60]
        raise _fail("sampling", shown, rule)
    if len(sampling) != num_rows:
        raise _fail("sampling", f"<{len(sampling)} entries>", f"must hold one entry per row ({num_rows})")
    return list(sampling)


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
    params = _row_sampling(sampling, num_rows)
    columns, table_columns = tokens.shape[1], table.shape[1]
    need = ceil_div_column(lengths, layout.block_size)  # <= 0 for a bad length, which the core names
    _check_list_widths(tokens, "tokens", lengths, "prompt length")
    _check_list_widths(table, "page_table", need, "mapped prefix")
    widest = max(need, default=0)
    if num_rows and (max(lengths) > columns or widest > table_columns):
        _raise_first_shape_rule(lengths, need, columns, table_columns)
    # One host conversion of the mapped columns; stale tails past each row's
    # prefix are never read. The core gets columns: no per-row objects.
    mapped = (table if widest == table_columns else table[:, :widest]).tolist()  # an empty batch fails in the core
    blocks = tuple(tuple(row[:n]) for row, n in zip(mapped, need))
    return PrefillBatch(tuple(lengths), tuple(cached), tuple(slot_ids), blocks, tuple(params))


def check_token_ids(tokens: torch.Tensor, batch: PrefillBatch, vocab_size: int) -> None:
    """Every prompt token (past each row's length anything goes) is in ``[0, vocab_size)``."""
    if tokens.numel() == 0:
        return
    low, high = torch.aminmax(tokens)
    if int(low) >= 0 and int(high) < vocab_size:
        return  # the whole matrix is in range: no per-row mask needed
    # Clamped: a length far outside the matrix (which the core names) must not overflow the tensor.
    lengths = torch.tensor([min(max(n, 0), tokens.shape[1]) for n in batch.lengths]).unsqueeze(1)
    inside = torch.arange(tokens.shape[1]).unsqueeze(0) < lengths  # [N, T]
    bad = inside & ((tokens < 0) | (tokens >= vocab_size))
    if bool(bad.any()):
        row, column = (int(i) for i in bad.nonzero()[0])
        value = int(tokens[row, column])
        rule = f"token ids must lie in [0, vocab_size={vocab_size})"
        raise PrefillInputError(f"row {row}: tokens[{column}]={value} is invalid: {rule}", row=row, field="tokens")
