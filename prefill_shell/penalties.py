"""vLLM's sampling penalties on one row's logits, and the host sampling of a penalised row.

vLLM's ``apply_penalties`` semantics:

* **repetition** (``r``, 1.0 none) over every token that occurs in the
  prompt or the output so far: a positive logit is divided by ``r``, any
  other multiplied by it;
* **frequency** (``f``) over output tokens only: ``f`` times the token's
  count is subtracted;
* **presence** (``p``) over output tokens only: ``p`` is subtracted once
  from every token that occurs.

The sampled token comes from the penalised logits (then temperature, top-k,
top-p, as ``torch_sampling.sample_row``); its returned log-prob is of the raw
distribution, before penalties, as vLLM's raw log-probs are.
"""

from __future__ import annotations

import torch

from .torch_sampling import sample_row

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
    """Penalised copy of ``logits [V]`` (float32); ``prompt_ids`` and ``output_ids`` are 1-D token ids."""
    vocab = logits.shape[-1]
    logits = logits.float().clone()
    output_counts = torch.bincount(output_ids.long(), minlength=vocab)[:vocab]  # [V]
    seen = output_counts > 0
    seen[prompt_ids.long()] = True
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, scaled, logits)
    logits -= frequency * output_counts.float()
    logits -= presence * (output_counts > 0).float()
    return logits


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
