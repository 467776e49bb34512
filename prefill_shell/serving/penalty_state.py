"""Penalty state as tt-transformers' runtime takes it: ``prompt_tokens``, ``output_tokens`` and ``slot_remap``.

Forms (tt-transformers ``prefill/runtime.py``, ``prepare``): ``prompt_tokens``
and ``output_tokens`` are a tensor, list or tuple whose leading axis is

* the lane's slots (``max_batch_size`` rows): row i is read at its slot
  (``empty_slots[i]``, else i);
* the call's rows: row i is row i;
* one row: broadcast to every row.

Any other leading length is an ``InvalidSamplingError`` naming the field
(checked when given, before anything runs). ``prompt_tokens`` defaults to
each row's prefill tokens up to its ``prompt_lens``; ``output_tokens`` to
none. Two ids are padding, as each sender pads: -1 (tt-transformers; vLLM's
placeholder for a not yet sampled output) and the vocabulary size (vLLM pads
``prompt_token_ids`` and ``output_token_ids`` with it: vllm-project/vllm
``vllm/v1/worker/gpu_input_batch.py`` ``_make_prompt_token_ids_tensor`` and
``vllm/v1/sample/ops/penalties.py`` ``_convert_to_tensors`` at v0.33.0,
counted in a bin past the vocabulary and dropped). Any other id outside
``[0, vocab)`` is an ``InvalidSamplingError`` naming the row, the field, the
id and its position, raised before anything runs.

``slot_remap`` moves slot-indexed decode state (there: seed streams, then
penalty history): one entry per slot, entry ``new`` naming the ``old`` slot
whose state moves to it, each in ``[0, max_batch_size)``, no old slot moved
to two new ones. Its form is checked here; this runtime keeps no state by
slot (a row's seed and penalty history come with each call), so there is
nothing for it to move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prefill_core.values.errors import InvalidSamplingError

__all__ = ["PAD_ID", "state_rows", "token_ids", "check_slot_remap"]

PAD_ID = -1
"""tt-transformers' pad id (and vLLM's placeholder output id); the vocabulary size is vLLM's pad."""


def _leading(value: Any, field: str) -> int:
    if isinstance(value, torch.Tensor):
        return 1 if value.dim() == 0 else int(value.shape[0])
    if isinstance(value, (list, tuple)):
        return len(value)
    msg = f"{field}={type(value).__name__} is invalid: must be a tensor, list or tuple of rows"
    raise InvalidSamplingError(msg, field=field)


def state_rows(value: Any, field: str, slots: Sequence[int], capacity: int) -> list | None:
    """``value``'s row for each call row (by slot, by row, or one broadcast); None when ``value`` is None."""
    if value is None:
        return None
    num_rows = len(slots)
    length = _leading(value, field)
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.reshape(1)
    if length == capacity:
        picks = list(slots)
    elif length == num_rows:
        picks = list(range(num_rows))
    elif length == 1:
        picks = [0] * num_rows
    else:
        rule = f"needs 1 row, the call's {num_rows} rows, or the lane's {capacity} slots"
        raise InvalidSamplingError(f"{field} has {length} rows, which is invalid: {rule}", field=field)
    if any(not 0 <= pick < length for pick in picks):
        rule = f"a row's slot lies outside its {length} rows"
        raise InvalidSamplingError(f"{field} has {length} rows, which is invalid: {rule}", field=field)
    return [value[pick] for pick in picks]


def token_ids(row_value: Any, field: str, row: int, vocab_size: int) -> torch.Tensor:
    """One row's token ids as int64 ``[n]``, padding (-1 and ``vocab_size``) dropped; anything else invalid is named."""
    try:
        ids = torch.as_tensor(row_value)
    except (TypeError, ValueError, RuntimeError) as error:
        ids = error
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype is torch.bool:
        shown = f"{type(row_value).__name__}: {ids!r}" if isinstance(ids, Exception) else f"<{ids.dtype}>"
        msg = f"row {row}: {field}={shown} is invalid: a penalised row needs its token ids (ints)"
        raise InvalidSamplingError(msg, row=row, field=field)
    ids = ids.to(torch.int64).reshape(-1)
    ids = ids[(ids != PAD_ID) & (ids != vocab_size)]
    outside = ((ids < 0) | (ids >= vocab_size)).nonzero().flatten()
    if len(outside):
        bad = int(ids[outside[0]])
        rule = f"each id must lie in [0, {vocab_size}) or be padding (-1, or the vocabulary size {vocab_size})"
        msg = f"row {row}: {field} holds id {bad}, which is invalid: {rule}"
        raise InvalidSamplingError(msg, row=row, field=field)
    return ids


def check_slot_remap(value: Any, capacity: int) -> None:
    """Raises ``InvalidSamplingError`` unless ``value`` is None or a valid remap of ``capacity`` slots."""
    if value is None:
        return
    flat = value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else value
    if not isinstance(flat, (list, tuple)) or len(flat) != capacity or any(type(v) is not int for v in flat):
        msg = f"slot_remap={value!r} is invalid: must hold one int per slot ({capacity})"
        raise InvalidSamplingError(msg, field="slot_remap")
    if any(not 0 <= old < capacity for old in flat):
        msg = f"slot_remap={value!r} is invalid: every entry must be a slot in [0, {capacity})"
        raise InvalidSamplingError(msg, field="slot_remap")
    moved = [old for new, old in enumerate(flat) if old != new]
    if len(set(moved)) != len(moved):
        msg = f"slot_remap={value!r} is invalid: one slot's state cannot move to two slots"
        raise InvalidSamplingError(msg, field="slot_remap")
