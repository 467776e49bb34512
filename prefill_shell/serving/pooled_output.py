"""Pooling requests through the plugin's facade: ``prefill_forward(..., pooling=)`` -> vLLM's ``pooler_output``.

A pooling model's runner in vLLM 0.33 (``vllm/v1/worker/gpu_model_runner.py``
``_pool``) holds every scheduled request's ``PoolingParams`` and whole prompt
length, runs the step, and hands back ``pooler_output``: one tensor per
request whose prompt the step completes (the pooler head's output, on the
host), None for a request whose prompt is still partial. The facade takes
the same per-row facts (``pooling``: one ``prefill_core`` ``PoolingParams`` or
None per row; ``pooling_prompt_lens``: each row's whole prompt length) and
returns that list. The model's side (pooling type, default normalisation,
Matryoshka, the classification head) is the facade's ``pooler`` and
``score``, as ``load_pooling_folder`` reads them from a folder.

``PoolingHead`` checks that side once, when the facade is built;
``pooled_rows`` checks a call's rows, all before anything runs, so a refused
call writes no KV; ``pooler_output`` applies the heads
(``engine.pooled_heads``) to the rows the runtime pooled.

What vLLM refuses is refused here by name (row, field, value, rule): a row
both sampled and pooled (vLLM gives a request ``SamplingParams`` or
``PoolingParams``, and runs a batch all pooling or none), a task the model
has no head for, ``dimensions`` without Matryoshka, and MEAN or CLS pooling
of a partial prefill (``seqwise/methods.py``). A MEAN or CLS row that starts
past position 0 is refused too: the positions its vector needs were
computed by an earlier step, which the runtime cannot pool across calls
(vLLM turns chunked prefill and prefix caching off for such a model, so its
scheduler never sends one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs
import torch

from prefill_core.values.errors import PrefillConfigError, row_error
from prefill_core.values.pooling import (
    InvalidPoolingError,
    PoolerConfig,
    PoolingPrefixError,
    PoolingType,
    ResolvedPooling,
    resolve_pooling,
)
from prefill_shell.backends.torch_backend import TorchBackend
from prefill_shell.engine.batch_builder import _int_vector
from prefill_shell.engine.pooled_heads import row_outputs

__all__ = ["PooledRows", "PoolingHead", "pooled_rows", "pooler_output"]


@attrs.frozen(eq=False)
class PoolingHead:
    """What a facade's model pools with: its ``PoolerConfig`` and the classification head ``score [L, H]``."""

    pooler: PoolerConfig
    score: torch.Tensor | None = None

    @classmethod
    def of(cls, owner: str, pooler: Any, score: Any, lanes: Sequence[tuple[Any, Any]]) -> PoolingHead | None:
        """The head of a facade built with ``pooler=`` and ``score=`` (None without them), checked against the
        lanes' ``(model, backend)`` pairs; a ``PrefillConfigError`` names what does not fit."""
        if pooler is None:
            if score is not None:
                raise PrefillConfigError(f"{owner}: score= is invalid without pooler= (the PoolerConfig it belongs to)")
            return None
        if not isinstance(pooler, PoolerConfig):
            raise PrefillConfigError(f"{owner}: pooler={type(pooler).__name__} is invalid: a PoolerConfig or None")
        hidden = lanes[0][0].spec.hidden_size
        if pooler.hidden_size != hidden:
            msg = f"{owner}: pooler.hidden_size={pooler.hidden_size} is invalid: the model's hidden size is {hidden}"
            raise PrefillConfigError(msg)
        if (score is None) != (pooler.num_labels is None):
            msg = f"{owner}: score= and pooler.num_labels={pooler.num_labels} come together (a classification head)"
            raise PrefillConfigError(msg)
        if score is not None:
            shape = tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__
            if shape != (pooler.num_labels, hidden) or not score.is_floating_point():
                rule = f"a floating-point tensor [num_labels, hidden] = [{pooler.num_labels}, {hidden}]"
                raise PrefillConfigError(f"{owner}: score of shape {shape} is invalid: {rule}")
            score = score.detach().float().cpu()
        for lane, (_, backend) in enumerate(lanes):
            if not isinstance(backend, TorchBackend):
                msg = (
                    f"{owner}: pooler= is invalid on lane {lane}'s {type(backend).__name__}: pooling reads each "
                    "step's final hidden states as torch tensors, which only the torch backend's are"
                )
                raise PrefillConfigError(msg)
        return cls(pooler, score)


class PooledRows(NamedTuple):
    """A checked pooling call: what the runtime pools per row, and each output row's resolved request."""

    types: list[PoolingType | None]  # PrefillCall.pooling: None where the step does not complete a pooled row
    resolved: list[ResolvedPooling | None]  # per row: what its output is, None where it has none this step


def pooled_rows(
    head: PoolingHead | None,
    pooling: Any,
    pooling_prompt_lens: Any,
    prompt_lens: Any,
    start_pos: Any,
    num_rows: int,
    sampled: bool,
) -> PooledRows:
    """Each row's pooling, checked before anything runs (``InvalidPoolingError`` / ``PoolingPrefixError``)."""
    if head is None:
        rule = "this facade has no pooler: build it with pooler= (a PoolerConfig) and score= for a classification head"
        raise InvalidPoolingError(f"pooling is invalid: {rule}", field="pooling")
    if isinstance(pooling, (str, bytes)) or not isinstance(pooling, Sequence):
        msg = f"pooling={type(pooling).__name__} is invalid: one PoolingParams or None per row ({num_rows} rows)"
        raise InvalidPoolingError(msg, field="pooling")
    if len(pooling) != num_rows:
        msg = f"pooling has {len(pooling)} entries for {num_rows} rows: one PoolingParams or None per row"
        raise InvalidPoolingError(msg, field="pooling")
    if sampled:
        row = next((r for r, params in enumerate(pooling) if params is not None), 0)
        rule = (
            "a row is sampled or pooled, not both (vLLM gives each request SamplingParams or PoolingParams, "
            "and runs a batch all pooling or none)"
        )
        raise InvalidPoolingError(
            f"row {row}: sampling_params with pooling is invalid: {rule}", row=row, field="pooling"
        )
    resolved = [
        None if params is None else resolve_pooling(row, params, head.pooler) for row, params in enumerate(pooling)
    ]
    lengths = _int_vector("prompt_lens", prompt_lens, num_rows)
    starts = [0] * num_rows if start_pos is None else _int_vector("start_pos", start_pos, num_rows)
    wholes = (
        lengths if pooling_prompt_lens is None else _int_vector("pooling_prompt_lens", pooling_prompt_lens, num_rows)
    )
    types: list[PoolingType | None] = []
    for row, (pooled, length, start, whole) in enumerate(zip(resolved, lengths, starts, wholes)):
        if whole < length:
            rule = f"at least prompt_lens={length}: each row's whole prompt, which this step computes up to prompt_lens"
            raise row_error(InvalidPoolingError, row, "pooling_prompt_lens", whole, rule)
        if pooled is None:
            types.append(None)
            continue
        kind = pooled.pooling_type
        if kind.reads_every_position and length < whole:
            rule = (
                f"{kind.value} pooling needs the whole prompt ({whole} tokens) in one step, as vLLM refuses a "
                f"partial prefill for MEAN and CLS (the runtime chunks a whole prompt itself)"
            )
            raise row_error(PoolingPrefixError, row, "prompt_lens", length, rule)
        if kind.reads_every_position and start > 0:
            rule = (
                f"{kind.value} pooling reads every position from 0, and a step starting at {start} computes none "
                "before it (vLLM turns prefix caching off for such a model)"
            )
            raise row_error(PoolingPrefixError, row, "start_pos", start, rule)
        complete = length == whole
        types.append(kind if complete else None)
        resolved[row] = pooled if complete else None
    return PooledRows(types, resolved)


def pooler_output(results: Sequence, rows: PooledRows, head: PoolingHead) -> list[torch.Tensor | None]:
    """vLLM's ``pooler_output`` of a call: each completed row's head output (float32, on the host), else None."""
    done = [row for row, pooled in enumerate(rows.resolved) if pooled is not None]
    out: list[torch.Tensor | None] = [None] * len(rows.resolved)
    if not done:
        return out
    pooled = torch.stack([results[row].pooled.float().cpu() for row in done])
    for row, vector in zip(done, row_outputs(pooled, [rows.resolved[row] for row in done], head.score)):
        out[row] = vector
    return out
