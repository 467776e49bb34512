"""The pooling math on host or device tensors: pool, truncate, normalise, classify.

* ``RowPool``: one row's running pool across the steps that compute it:
  the last position's hidden state (LAST), position 0's (CLS), or a float32
  sum and a count (MEAN: the mean is taken once, after the last step, so a
  row split over chunks or packed steps pools exactly as one pass would).
* ``embed_vectors``: truncate to ``dimensions``, then L2-normalise, as vLLM's
  ``EmbeddingPoolerHead`` orders them (vllm-project/vllm
  ``vllm/model_executor/layers/pooler/seqwise/heads.py``, commit 055e47c);
  sentence-transformers' ``encode(truncate_dim=d, normalize_embeddings=True)``
  gives the same vector (it truncates after its modules, then normalises).
* ``classify_logits`` / ``activate``: the ``score`` linear over the pooled
  state, then the row's activation (``prefill_core.values.pooling.ClassifyActivation``).
* ``yes_no_probability``: the Qwen3-Reranker recipe: the LM head's logits
  of "yes" and "no" at the last token, ``P(yes) = softmax([no, yes])[1]``.

Pooling and heads run in float32 whatever the model dtype (vLLM's MEAN sums
in float32; sentence-transformers accumulates half-precision means in
float32 too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from prefill_core.values.pooling import ClassifyActivation, PoolingType, ResolvedPooling

__all__ = ["RowPool", "activate", "classify_logits", "embed_vectors", "yes_no_probability"]


class RowPool:
    """One row's pooled state, fed position runs of hidden states in position order."""

    def __init__(self, pooling_type: PoolingType):
        self.pooling_type = pooling_type
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._vector: torch.Tensor | None = None

    def add(self, hidden: torch.Tensor) -> None:
        """``hidden [n, H]``: the states of positions this pool needs (``prefill_core.pooled_positions``)."""
        if self.pooling_type is PoolingType.MEAN:
            part = hidden.float().sum(dim=0)
            self._sum = part if self._sum is None else self._sum + part
            self._count += hidden.shape[0]
        elif self.pooling_type is PoolingType.LAST:
            self._vector = hidden[-1].to(torch.float32, copy=True)  # a copy: a replay overwrites its workspace
        elif self._vector is None:  # CLS: the first position fed, position 0
            self._vector = hidden[0].to(torch.float32, copy=True)

    def result(self) -> torch.Tensor:
        """The pooled float32 vector ``[H]``."""
        if self.pooling_type is PoolingType.MEAN:
            if self._sum is None:
                raise RuntimeError("a MEAN pool was read before any position was added")
            return self._sum / self._count
        if self._vector is None:
            raise RuntimeError(f"a {self.pooling_type.value} pool was read before its position was added")
        return self._vector


def embed_vectors(pooled: torch.Tensor, rows: Sequence[ResolvedPooling]) -> list[torch.Tensor]:
    """Each embed row's vector: ``pooled [N, H]`` truncated to its ``dimensions``, then normalised if asked."""
    out = []
    for vector, row in zip(pooled, rows):
        if row.dimensions is not None:
            vector = vector[: row.dimensions]
        if row.normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        out.append(vector)
    return out


def activate(logits: torch.Tensor, activation: ClassifyActivation) -> torch.Tensor:
    """``logits [..., L]`` under one ``ClassifyActivation`` (softmax over the labels)."""
    if activation is ClassifyActivation.SIGMOID:
        return torch.sigmoid(logits)
    if activation is ClassifyActivation.SOFTMAX:
        return torch.softmax(logits, dim=-1)
    return logits


def classify_logits(pooled: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``score`` head: ``pooled [N, H] @ weight[L, H]^T (+ bias)`` in float32."""
    return F.linear(pooled.float(), weight.float(), None if bias is None else bias.float())


def yes_no_probability(lm_logits: torch.Tensor, yes: int, no: int) -> torch.Tensor:
    """``P(yes)`` over {no, yes} from the last token's LM logits ``[N, V]``: the Qwen3-Reranker score."""
    pair = torch.stack((lm_logits[:, no], lm_logits[:, yes]), dim=-1).float()
    return torch.softmax(pair, dim=-1)[:, 1]
