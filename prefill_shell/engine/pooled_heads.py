"""The heads over pooled vectors: truncate, normalise, classify, and the yes/no reranker.

* Pooling itself (LAST, MEAN, CLS across steps) is a call output of the
  runtime (``prefill_shell.engine.steps.pooled_states``); these are the heads
  over the pooled vectors. They live in the engine because two clients
  apply them: ``prefill_shell.pooling.PoolingRunner`` and the serving
  facade's ``prefill_forward(..., pooling=)``, which may not import each other.
* ``embed_vectors``: truncate to ``dimensions``, then L2-normalise, as vLLM's
  ``EmbeddingPoolerHead`` orders them (vllm-project/vllm
  ``vllm/model_executor/layers/pooler/seqwise/heads.py`` at commit
  055e47c28003156421365af985d676fc921cb075);
  sentence-transformers' ``encode(truncate_dim=d, normalize_embeddings=True)``
  gives the same vector (it truncates after its modules, then normalises).
* ``classify_logits`` / ``activate``: the ``score`` linear over the pooled
  state, then the row's activation (``prefill_core.values.pooling.ClassifyActivation``).
* ``row_outputs``: each row's output by its task, the two heads above
  batched over the rows of each task (what a pooling client returns per row).
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

from prefill_core.values.pooling import ClassifyActivation, PoolingTask, ResolvedPooling

__all__ = ["activate", "classify_logits", "embed_vectors", "row_outputs", "yes_no_probability"]


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


def row_outputs(
    pooled: torch.Tensor, rows: Sequence[ResolvedPooling], score: torch.Tensor | None
) -> list[torch.Tensor]:
    """Each row's output from ``pooled [N, H]``: the embedding (embed rows) or the activated label scores
    (classify rows, through ``score [L, H]``), float32, in row order."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    embed = [i for i, r in enumerate(rows) if r.task is PoolingTask.EMBED]
    for i, vector in zip(embed, embed_vectors(pooled[embed], [rows[i] for i in embed])):
        out[i] = vector
    classify = [i for i, r in enumerate(rows) if r.task is PoolingTask.CLASSIFY]
    if classify:
        logits = classify_logits(pooled[classify], score)
        for i, row_logits in zip(classify, logits):
            out[i] = activate(row_logits, rows[i].activation)
    return out


def yes_no_probability(lm_logits: torch.Tensor, yes: int, no: int) -> torch.Tensor:
    """``P(yes)`` over {no, yes} from the last token's LM logits ``[N, V]``: the Qwen3-Reranker score."""
    pair = torch.stack((lm_logits[:, no], lm_logits[:, yes]), dim=-1).float()
    return torch.softmax(pair, dim=-1)[:, 1]
