"""``RuntimePoolingModel``: the model object vllm-tt-plugin's pooling runner calls, backed by the runtime.

The plugin's ``TTPoolingModelRunner`` (tenstorrent/vllm-tt-plugin
``vllm_tt_plugin/pooling_runner.py``) right-pads every scheduled prompt to
the batch's longest, builds a 0/1 ``attention_mask`` and calls
``model.forward(input_ids=..., attention_mask=...)``; it expects one vector
per request back, ``[batch, hidden]`` for an embedding model or
``[batch, 1]`` (the relevance logit) for a cross-encoder, and puts row ``i``
into ``pooler_output``. This object keeps that call unchanged and hands the
real tokens only (the mask's ones, left or right padding alike) to a
``PoolingRunner``: packed steps, chunks, shared prefixes computed once.
"""

from __future__ import annotations

import torch

from prefill_core.values.pooling import InvalidPoolingError, PoolingParams
from prefill_shell.pooling.runner import PoolingRunner

__all__ = ["RuntimePoolingModel"]


class RuntimePoolingModel:
    """``forward(input_ids, attention_mask) -> [batch, width]`` over a ``PoolingRunner``.

    ``pooling``: what every row gets; by default the folder's embedding
    (its pooling and normalisation) for a model without a head, and the raw
    head logits (``use_activation=False``, as the plugin's runner passes a
    cross-encoder's logit on) for one with a head.
    """

    def __init__(self, runner: PoolingRunner, pooling: PoolingParams | None = None):
        if pooling is None:
            head = runner.pooler.num_labels is not None
            pooling = PoolingParams.classify(use_activation=False) if head else PoolingParams.embed()
        self.runner = runner
        self.pooling = pooling

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise InvalidPoolingError(f"input_ids has shape {tuple(input_ids.shape)}: [batch, seq]", field="input_ids")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if mask.shape != input_ids.shape:
            raise InvalidPoolingError(
                f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}: the same",
                field="attention_mask",
            )
        rows = [ids[keep].tolist() for ids, keep in zip(input_ids, mask)]
        for row, tokens in enumerate(rows):
            if not tokens:
                raise InvalidPoolingError(f"row {row}: attention_mask keeps no token", row=row, field="attention_mask")
        return torch.stack(self.runner.run(rows, self.pooling))

    __call__ = forward
