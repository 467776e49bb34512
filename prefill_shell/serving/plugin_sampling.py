"""Sampling parameters as vLLM's Tenstorrent plugin sends them -> one ``RowSampling`` per row (``PluginRows``).

The plugin's ``TTSamplingParams`` carries, per row (a list, a 1-D tensor, or
one scalar for every row): ``temperature``, ``top_k``, ``top_p``,
``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``,
``seed``, ``num_logprobs`` and ``enable_log_probs``. Its encodings
(vllm-tt-plugin ``input_batch.py``), and what each becomes here:

* ``top_k <= 0`` (or ``>= vocab``, which is what the plugin sends for it)
  means the whole vocabulary: the core's ``top_k = 0``.
* A greedy row arrives as ``top_k == 1`` with ``top_p = 0.0`` (the plugin
  zeroes top_p for top_k 1), or, for vLLM's temperature-0 request, as
  temperature 0.0 with ``top_k = vocab`` and ``top_p = 1.0`` (vLLM clears
  top_k and top_p of a greedy request); the core takes a temperature below
  1e-5 as greedy. Greedy is never refused: ``SamplingParams.greedy``.
  ``top_p == 0`` on its own keeps the single most likely token, as the device
  sampler's nucleus does: greedy too.
* ``seed == -1`` (or ``None``: ``submit_prefill`` turns -1 into ``None``)
  means no seed: the runtime's generator draws one.
* ``num_logprobs``: ``-2`` (or ``None``) none, ``0`` the sampled token's
  log-prob. ``-1`` (the whole vocabulary) and ``k > 0`` (top-k lists) cannot
  be honoured: the prefill return holds one log-prob per row, so they are a
  named error, never silently cut. ``enable_log_probs``, when given, says
  per row whether the sampled token's log-prob is wanted.
* Penalties keep vLLM's domains (presence and frequency in [-2, 2],
  repetition > 0); a row with any non-neutral penalty is sampled on the host
  (``penalties.py``) from the device's logits. The runtime then sees no
  sampling for that row, so the core's temperature, top-k, top-p and seed
  rules judge its values here, before anything runs.

Every other value goes to the core's ``SamplingParams`` as it is, so the
rule table names a bad temperature or top-p with its row.

Each distinct encoding is mapped once per call, at the first row holding it
(the row an error names); rows holding equal encodings share its objects,
so the core judges each distinct ``SamplingParams`` once. ``PluginRows``
also lists, once, what the facade needs beside the core's sampling list:
the penalised rows and the rows wanting a log-prob.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from prefill_core import PrefillBatch, SamplingParams
from prefill_core.inputs.rule_finds import type_note
from prefill_core.inputs.rules import RULES, Scope
from prefill_core.values.errors import InvalidSamplingError, row_error

__all__ = ["Penalties", "PluginRows", "RowSampling", "rows_from_plugin"]

_NAMES = ("temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_NAMES += ("seed", "num_logprobs", "enable_log_probs")
_NO_LOGPROBS = -2
_NO_SEED = -1
_GREEDY = SamplingParams(temperature=0.0, top_k=1, top_p=1.0)  # a seedless greedy row: one shared value
_DEFAULTS = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "seed": _NO_SEED,
    "num_logprobs": None,
    "enable_log_probs": None,
}


@attrs.frozen
class Penalties:
    """vLLM's three penalties for one row (``repetition`` 1.0, the others 0.0: none)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0

    @property
    def neutral(self) -> bool:
        return self.repetition == 1.0 and self.presence == 0.0 and self.frequency == 0.0


_NO_PENALTIES = Penalties()
_HOST_SAMPLED_RULES = tuple(rule for rule in RULES if rule.name in ("temperature", "top_k", "top_p", "seed"))


@attrs.frozen
class RowSampling:
    """One row's sampling: the core's params, its penalties, and whether its token's log-prob is wanted."""

    params: SamplingParams
    penalties: Penalties
    wants_logprob: bool


def _field(sampling: Any, name: str, num_rows: int) -> Any:
    """The field ``name``: a list of one Python value per row, or one value for every row (a scalar)."""
    value = getattr(sampling, name, _DEFAULTS.get(name))
    if value is None or isinstance(value, (int, float)):  # one value for every row (the usual optional field)
        return value
    if isinstance(value, (list, tuple)):
        return _rows_value(name, value, num_rows)
    if isinstance(value, torch.Tensor):
        return value.item() if value.dim() == 0 else _rows_value(name, value.tolist(), num_rows)
    if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
        # A numpy array, range or dict would be taken for one value held by every row, and named at row 0.
        rule = "must be one value for every row, or one per row as a list, tuple or 1-D tensor (numpy: .tolist())"
        msg = f"sampling_params.{name}=<{type(value).__name__}> is invalid: {rule}"
        raise InvalidSamplingError(msg, field=f"sampling_params.{name}")
    return value


def _rows_value(name: str, values: list | tuple, num_rows: int) -> Any:
    """A per-row list cut to the batch, or its one value when every row holds it."""
    if len(values) < num_rows:
        msg = f"sampling_params.{name}=<{len(values)} values> is invalid: must hold one value per row ({num_rows})"
        raise InvalidSamplingError(msg, field=f"sampling_params.{name}")
    items = values[:num_rows]  # the plugin may pad rows past the batch: they are not rows here
    if not items:
        return list(items)
    first = items[0]
    # Equal values of one type: 1 == True == 1.0, and a row's True must still meet the rules as a bool.
    if items.count(first) == len(items) and {type(item) for item in items} == {type(first)}:
        _check_one_value(name, 0, first)
        return first  # one value held by every row is every row's value
    for row, item in enumerate(items):
        _check_one_value(name, row, item)
    return list(items)


def _check_one_value(name: str, row: int, item: Any) -> None:
    """A row's entry is one value: a nested list (a 2-D tensor's rows) would be taken for a row list."""
    if isinstance(item, (list, tuple, dict, set, torch.Tensor)):
        rule = "must hold one value per row (a list or 1-D tensor of numbers), not a nested list"
        raise row_error(InvalidSamplingError, row, f"sampling_params.{name}", item, rule)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: int | float) -> bool:
    """``math.isfinite`` that calls an int too large for a float infinite instead of raising ``OverflowError``."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _penalties(row: int, presence: Any, frequency: Any, repetition: Any) -> Penalties:
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not _is_number(value) or not -2.0 <= value <= 2.0:
            rule = "must be a number in [-2, 2]" + type_note(value, float)
            raise row_error(InvalidSamplingError, row, f"sampling_params.{name}", value, rule)
    if not _is_number(repetition) or not _is_finite(repetition) or repetition <= 0:
        rule = "must be a finite number > 0 (1.0: none)" + type_note(repetition, float)
        raise row_error(InvalidSamplingError, row, "sampling_params.repetition_penalty", repetition, rule)
    if repetition == 1.0 and presence == 0.0 and frequency == 0.0:
        return _NO_PENALTIES
    return Penalties(float(repetition), float(presence), float(frequency))


def _wants_logprob(row: int, num_logprobs: Any, enabled: Any) -> bool:
    if num_logprobs is None or type(num_logprobs) is int and num_logprobs == _NO_LOGPROBS:
        wanted = False
    elif type(num_logprobs) is int and num_logprobs == 0:  # an int: 0.0 and False are not the plugin's encoding
        wanted = True
    else:
        rule = (
            "must be -2 (none) or 0 (the sampled token's log-prob): the prefill return holds one log-prob per "
            "row, so -1 (whole vocabulary) and top-k lists cannot be returned"
        ) + type_note(num_logprobs, int)
        raise row_error(InvalidSamplingError, row, "sampling_params.num_logprobs", num_logprobs, rule)
    if enabled is not None and enabled not in (True, False):
        rule = "must be a bool per row (or None: num_logprobs decides)"
        raise row_error(InvalidSamplingError, row, "sampling_params.enable_log_probs", enabled, rule)
    return wanted if enabled is None else bool(enabled)


def _core_params(temperature: Any, top_k: Any, top_p: Any, seed: Any, vocab_size: int) -> SamplingParams:
    """The core's parameters; values outside the encodings pass through for the rule table to name."""
    seed = None if seed is None or seed == _NO_SEED else seed
    if type(top_k) is int and top_k == 1 or _is_number(top_p) and top_p == 0.0:
        return _GREEDY if seed is None else SamplingParams(temperature=0.0, top_k=1, top_p=1.0, seed=seed)
    if type(top_k) is int and (top_k <= 0 or top_k >= vocab_size):
        top_k = 0
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def _check_host_sampled(row: int, params: SamplingParams) -> None:
    """The core's sampling rules on a row the facade samples itself (the runtime sees no params for it)."""
    scope = Scope(PrefillBatch((1,), (0,), (0,), ((0,),), (params,)))  # the row alone, as a one-row batch
    for rule in _HOST_SAMPLED_RULES:
        hit = rule.find(scope)
        if hit is not None:
            raise rule.error_for(attrs.evolve(hit, row=row), None)


def _row_sampling(row: int, values: dict[str, Any], vocab_size: int) -> RowSampling:
    """One row's ``RowSampling`` from its field values (``row`` names it in an error)."""
    params = _core_params(values["temperature"], values["top_k"], values["top_p"], values["seed"], vocab_size)
    penalties = _penalties(row, values["presence_penalty"], values["frequency_penalty"], values["repetition_penalty"])
    if not penalties.neutral:
        _check_host_sampled(row, params)
    return RowSampling(params, penalties, _wants_logprob(row, values["num_logprobs"], values["enable_log_probs"]))


@attrs.frozen
class PluginRows:
    """A call's sampling row by row, and the rows the facade treats apart, each listed once."""

    rows: list[RowSampling]  # one per row; rows holding one encoding share one object
    core: list[SamplingParams | None]  # what the runtime gets: None at a row sampled here (it returns logits)
    penalised: list[int]  # rows with a penalty: sampled on the host from their logits
    logprob_rows: list[int]  # rows that want their sampled token's log-prob

    @classmethod
    def uniform(cls, one: RowSampling, num_rows: int) -> PluginRows:
        """Every row holds ``one``: nothing to judge row by row."""
        penalised = [] if one.penalties.neutral else list(range(num_rows))
        core = [None if penalised else one.params] * num_rows
        return cls([one] * num_rows, core, penalised, list(range(num_rows)) if one.wants_logprob else [])

    @classmethod
    def per_row(cls, rows: list[RowSampling]) -> PluginRows:
        """Each row holds its own ``RowSampling`` (rows sharing an encoding share the object)."""
        penalised = [row for row, sampling in enumerate(rows) if not sampling.penalties.neutral]
        core = [sampling.params if sampling.penalties.neutral else None for sampling in rows]
        return cls(rows, core, penalised, [row for row, sampling in enumerate(rows) if sampling.wants_logprob])


def rows_from_plugin(sampling: Any, num_rows: int, vocab_size: int) -> PluginRows:
    """The rows' sampling from a ``TTSamplingParams``-like object (attributes read by name)."""
    for name in _NAMES[:3]:
        if not hasattr(sampling, name):
            msg = f"sampling_params has no {name}: it must carry temperature, top_k and top_p (TTSamplingParams)"
            raise InvalidSamplingError(msg, field=f"sampling_params.{name}")
    values = {name: _field(sampling, name, num_rows) for name in _NAMES}
    per_row = [name for name in _NAMES if isinstance(values[name], list)]
    if num_rows == 0:
        return PluginRows([], [], [], [])
    if not per_row:  # one value for every row: one mapping, named at row 0
        return PluginRows.uniform(_row_sampling(0, values, vocab_size), num_rows)
    # Rows usually share a few value tuples: each is mapped (and checked) once, at the first row holding it,
    # and rows that share one share its objects, so the core judges each distinct parameter object once.
    mapped: dict[tuple, RowSampling] = {}
    rows = []
    for row, entries in enumerate(zip(*(values[name] for name in per_row))):
        key = tuple((type(entry), entry) for entry in entries)  # 1 == True == 1.0: the type is part of the value
        found = mapped.get(key)
        if found is None:
            found = mapped[key] = _row_sampling(row, {**values, **dict(zip(per_row, entries))}, vocab_size)
        rows.append(found)
    return PluginRows.per_row(rows)
