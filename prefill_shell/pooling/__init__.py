"""Embeddings and reranking over the runtime: pooled outputs of the final hidden states.

``collector`` (the
one runtime-facing piece: each step's hidden output in, each row's pooled
vector out), ``runner`` (``PoolingRunner``: ``embed``, ``classify``,
``score``, ``rerank`` over a model and its block pool, a shared query
computed once), ``plugin_model`` (``RuntimePoolingModel``: the
``forward(input_ids, attention_mask)`` object vllm-tt-plugin's pooling
runner calls, real tokens only). The heads over pooled vectors (Matryoshka
truncation then normalisation, the classification head with vLLM's
activations, the Qwen3-Reranker yes/no recipe) are
``prefill_shell.engine.pooled_heads``, shared with the serving facade. The
folders load through ``prefill_shell.reference`` (``load_pooling_folder``).
Rules and values: ``prefill_core.values.pooling``.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch

from prefill_shell.pooling.plugin_model import RuntimePoolingModel
from prefill_shell.pooling.runner import PoolingRunner

__all__ = ["PoolingRunner", "RuntimePoolingModel"]
