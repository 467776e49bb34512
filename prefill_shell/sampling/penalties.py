"""vLLM's sampling penalties on one row's logits, and the host sampling of a penalised row.

vLLM's ``apply_penalties`` semantics:

* **repetition** (``r``, 1.0 none) over every token that occurs in the
  prompt or the output so far: a positive logit is divided by ``r``, any
  other multiplied by it;
* **frequency** (``f``) over output tokens only: ``f`` times the token's
  count is subtracted;
* **presence** (``p``) over output tokens only: ``p`` is subtracted once
  from every token that occurs.

A penalty extreme enough to push logits past float32's range (vLLM
accepts any ``r > 0``) samples its limit, never a NaN row's token 0
(``_limit_if_overflowed``).

The sampled token comes from the penalised logits (then temperature, top-k,
top-p, as ``torch_sampling.sample_row``); its returned log-prob is of the raw
distribution, before penalties, as vLLM's raw log-probs are.
"""

from __future__ import annotations

import torch

from prefill_core.values.errors import InvalidSamplingError
from prefill_shell.sampling.torch_sampling import sample_row

__all__ = ["apply_penalties", "sample_penalised"]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    *,
    repetition: float,
    presence: float,
    frequency: float,
) -> torch.Tensor:
    """Penalised copy of ``logits [V]`` (float32); ``prompt_ids`` and ``output_ids`` are 1-D token ids in ``[0, V)``.

    Padding is the caller's to drop (``serving.penalty_state.token_ids``); an id
    outside the vocabulary is an ``InvalidSamplingError`` naming the field, never
    an ``IndexError`` (prompt ids) or an id ignored (output ids).
    """
    vocab = logits.shape[-1]
    for field, ids in (("prompt_ids", prompt_ids), ("output_ids", output_ids)):
        outside = ((ids < 0) | (ids >= vocab)).nonzero().flatten()
        if len(outside):
            msg = f"{field} holds id {int(ids[outside[0]])}, which is invalid: each id must lie in [0, {vocab})"
            raise InvalidSamplingError(msg, field=field)
    raw = logits.float()
    output_counts = torch.bincount(output_ids.long(), minlength=vocab)[:vocab]  # [V]
    seen = output_counts > 0
    seen[prompt_ids.long()] = True
    # A zero logit stays zero: with a penalty past float32's range, 0 * inf would be NaN.
    scaled = torch.where(raw > 0, raw / repetition, torch.where(raw < 0, raw * repetition, raw))
    logits = torch.where(seen, scaled, raw)
    logits -= frequency * output_counts.float()
    logits -= presence * (output_counts > 0).float()
    return _limit_if_overflowed(logits, raw)


def _limit_if_overflowed(penalised: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """The penalised row, or its limit when a penalty pushed its largest logit past the float range.

    A tiny ``r`` sends positive seen logits to +inf, a huge one every seen
    negative logit to -inf (all of them, when every token was seen). Ordered
    by ``l / r`` or ``l * r``, the token with the largest raw logit among
    those at that extreme takes all the probability as ``r`` goes there, so
    that is the distribution returned (softmax of inf values would be NaN).
    """
    top = penalised.max()
    if not torch.isinf(top):
        return penalised
    at_top = penalised == top
    best = raw.masked_fill(~at_top, float("-inf")).max()
    return torch.full_like(penalised, float("-inf")).masked_fill(at_top & (raw == best), 0.0)


def sample_penalised(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    penalties,
    params,
    seed: int,
) -> tuple[int, float]:
    """``(token, its raw log-prob)`` for one row: penalties, then the row's temperature, top-k and top-p.

    ``penalties`` is a ``plugin_sampling.Penalties``-like value, ``params``
    the row's ``SamplingParams`` (greedy rows take the penalised argmax).
    """
    penalised = apply_penalties(
        logits,
        prompt_ids,
        output_ids,
        repetition=penalties.repetition,
        presence=penalties.presence,
        frequency=penalties.frequency,
    )
    token = int(sample_row(penalised, params.top_k, params.top_p, params.temperature, seed))
    raw = torch.log_softmax(logits.float(), dim=-1)
    return token, float(raw[token])
