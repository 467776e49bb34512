"""``PoolingRunner``: embed, classify, score and rerank through the runtime.

One runner owns a model, its pooler (``prefill_core.values.pooling.PoolerConfig``),
the classification head where there is one, a block pool and a
``PrefillRuntime`` over it (packed steps for mixed lengths, chunks past
``max_chunk``). A call:

1. resolves every row's ``PoolingParams`` against the pooler (named errors);
2. cuts the rows into rounds whose blocks fit the pool;
3. per round, lays the rows out with the scorer's prefix sharing
   (``prefill_shell.scoring.prefix_sharing``): rows whose pooling reads only
   the last position (LAST, so every classify row of a LAST model) and
   that start with the same whole blocks share them, computed once by a
   prefix call; a MEAN or CLS row never shares (it needs every position:
   ``prefill_core.values.pooling.effective_cached`` recomputes it);
4. runs the round (``collector.pooled_call``) and applies the heads
   (``engine.pooled_heads``): truncate then normalise for embed rows, the ``score``
   linear and its activation for classify rows.

Reranking one query against many documents puts the query first in every
row (the cross-encoder pair, or the Qwen3-Reranker prompt), so the query's
blocks are computed once for the whole list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from prefill_core import PageTableLayout, PrefillPolicy, SamplingPath, ceil_div, manifest_for
from prefill_core.values.errors import CapacityError, PrefillConfigError
from prefill_core.values.pooling import (
    PoolerConfig,
    PoolingParams,
    PoolingType,
    effective_cached,
    resolve_rows,
)
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.pooled_heads import row_outputs, yes_no_probability
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.pooling.collector import pooled_call
from prefill_shell.reference.loading.pooling_folder import PoolingFolder, load_pooling_folder
from prefill_shell.scoring.prefix_sharing import share_prefixes, sharing_groups
from prefill_shell.scoring.setup import scoring_policy

__all__ = ["PoolingRunner", "QWEN3_RERANKER_PREFIX", "QWEN3_RERANKER_SUFFIX", "qwen3_reranker_prompt"]

DEFAULT_POOL_TOKENS = 16384
"""The block pool's default size in tokens: a round holds rows of at most this many tokens together."""

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
"""The Qwen3-Reranker model card's prompt (Qwen/Qwen3-Reranker-0.6B README: ``format_instruction``)."""


def qwen3_reranker_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """One (query, document) prompt of the Qwen3-Reranker recipe; the query comes first, so it is shared."""
    instruction = instruction or "Given a web search query, retrieve relevant passages that answer the query"
    body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    return QWEN3_RERANKER_PREFIX + body + QWEN3_RERANKER_SUFFIX


class PoolingRunner:
    """Pooled outputs of a model through a ``PrefillRuntime`` (see the module docstring)."""

    def __init__(
        self,
        model,
        pooler: PoolerConfig,
        *,
        score: torch.Tensor | None = None,
        tokenizer=None,
        max_seq_length: int | None = None,
        block_size: int = 32,
        max_chunk: int = 512,
        pool_tokens: int = DEFAULT_POOL_TOKENS,
        device: str = "cpu",
        policy: PrefillPolicy | None = None,
        max_length: int | None = None,
    ):
        if (score is None) != (pooler.num_labels is None):
            raise PrefillConfigError("PoolingRunner: a score head and the pooler's num_labels come together")
        self.model = model
        self.pooler = pooler
        self.score_head = score
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.block_size = block_size
        self.computed_tokens = 0  # positions the model computed, prefix calls included (prefix sharing shows here)
        num_blocks = max(ceil_div(pool_tokens, block_size), 1)
        longest = model.spec.max_position if max_length is None else max_length
        layout = PageTableLayout(block_size, ceil_div(longest, block_size), num_blocks)
        kv = model.new_kv_cache(num_blocks, block_size)
        policy = scoring_policy(block_size, max_chunk) if policy is None else policy
        self.runtime = PrefillRuntime(
            PrefillRuntimeConfig.resolve(model, TorchBackend(device), kv, layout=layout, policy=policy)
        )

    @classmethod
    def from_folder(
        cls, folder: str | Path | PoolingFolder, *, dtype: str | None = None, device: str = "cpu", **options
    ) -> PoolingRunner:
        """A runner over a sentence-transformers, sequence-classification or causal-LM folder.

        The folder's tokenizer is loaded with transformers where it has one
        (``tokenizer_config.json``); ``options`` are the constructor's.
        """
        loaded = (
            folder if isinstance(folder, PoolingFolder) else load_pooling_folder(folder, device=device, dtype=dtype)
        )
        tokenizer = options.pop("tokenizer", None)
        if tokenizer is None and (loaded.folder / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(loaded.folder)
        return cls(
            loaded.model,
            loaded.pooler,
            score=loaded.score,
            tokenizer=tokenizer,
            max_seq_length=options.pop("max_seq_length", loaded.max_seq_length),
            device=device,
            **options,
        )

    def warm_up(self, on_progress=None) -> None:
        """Captures every trace the runner's policy and layout plan (``mode="traced"`` calls replay them).

        A traced call plans the padded waves a trace serves; the hidden-state
        hook reads each replay's output as it reads an eager step's.
        """
        manifest = manifest_for(self.runtime.config.policy, self.runtime.config.layout, [SamplingPath.LOGITS])
        PrefillExecutor(self.runtime).warm_up(manifest, on_progress)

    # -- token ids in, pooled rows out ---------------------------------------
    def run(
        self,
        prompts: Sequence[Sequence[int]],
        pooling: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        share_prefixes: bool = True,
        mode: str = "auto",
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[torch.Tensor]:
        """Each row's output: its embedding (embed) or its activated label scores (classify), float32.

        ``pooling``: one ``PoolingParams`` for every row, one per row, or None (embed with the model's defaults).
        """
        prompts = [list(p) for p in prompts]
        rows = resolve_rows(PoolingParams() if pooling is None else pooling, len(prompts), self.pooler)
        pooled, _ = self._pooled(prompts, rows, share_prefixes, mode, on_progress, want_logits=False)
        return row_outputs(pooled, rows, self.score_head)

    def _rounds(self, prompts: list[list[int]]) -> list[list[int]]:
        """Consecutive rows whose blocks (unshared, an upper bound) fit the pool together."""
        capacity = self.runtime.config.layout.num_blocks
        rounds, current, used = [], [], 0
        for index, prompt in enumerate(prompts):
            need = ceil_div(len(prompt), self.block_size)
            if need > capacity:
                raise CapacityError(
                    f"row {index}: {len(prompt)} tokens need {need} blocks; the pool holds {capacity} "
                    "(raise pool_tokens)",
                    row=index,
                    field="prompt",
                )
            if current and used + need > capacity:
                rounds.append(current)
                current, used = [], 0
            current.append(index)
            used += need
        if current:
            rounds.append(current)
        return rounds

    def _pooled(self, prompts, rows, share, mode, on_progress, *, want_logits: bool):
        hidden = self.model.spec.hidden_size
        pooled = torch.zeros(len(prompts), hidden, dtype=torch.float32)
        logits: list[torch.Tensor | None] = [None] * len(prompts)
        done = 0
        for members in self._rounds(prompts):
            sub = [prompts[i] for i in members]
            sub_rows = [rows[i] for i in members]
            groups = []
            if share:
                last = [j for j, r in enumerate(sub_rows) if r.pooling_type is PoolingType.LAST]
                groups = [[last[k] for k in g] for g in sharing_groups([sub[j] for j in last], self.block_size)]
            laid = share_prefixes(sub, self.block_size, groups)
            runtime = self.runtime
            if laid.prefixes:
                tokens, table, lengths = laid.prefix_call()
                runtime.prefill(tokens, table, lengths, mode=mode)
                self.computed_tokens += sum(lengths)
            cached = effective_cached(sub_rows, laid.cached)
            types = [r.pooling_type for r in sub_rows]
            call = pooled_call(
                runtime, laid.tokens, laid.page_table, list(laid.lengths), list(cached), types, mode=mode
            )
            self.computed_tokens += call.computed
            for j, i in enumerate(members):
                pooled[i] = call.pooled[j]
                if want_logits:
                    logits[i] = call.results[j].logits
            done += len(members)
            if on_progress is not None:
                on_progress(done, len(prompts))
        return pooled, logits

    # -- text in ---------------------------------------------------------------
    def _encode(self, text: str, pair: str | None = None) -> list[int]:
        if self.tokenizer is None:
            raise PrefillConfigError("this runner has no tokenizer: pass token ids to run(), or tokenizer=")
        kwargs = {} if self.max_seq_length is None else {"truncation": True, "max_length": self.max_seq_length}
        return list(self.tokenizer(text, pair, **kwargs)["input_ids"])

    def embed(
        self,
        texts: Sequence[str],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        mode: str = "auto",
    ) -> torch.Tensor:
        """``[len(texts), dimensions or hidden]`` float32 embeddings (texts tokenized as sentence-transformers does)."""
        prompts = [self._encode(t) for t in texts]
        params = PoolingParams.embed(dimensions=dimensions, normalize=normalize)
        vectors = self.run(prompts, params, on_progress=on_progress, mode=mode)
        return torch.stack(vectors) if vectors else torch.empty(0, dimensions or self.model.spec.hidden_size)

    def classify(self, texts: Sequence[str], *, use_activation: bool | None = None, mode: str = "auto") -> torch.Tensor:
        """``[len(texts), num_labels]``: each text's label scores (the head's activation unless turned off)."""
        prompts = [self._encode(t) for t in texts]
        return torch.stack(self.run(prompts, PoolingParams.classify(use_activation=use_activation), mode=mode))

    def score(
        self,
        query: str,
        documents: Sequence[str],
        *,
        use_activation: bool | None = None,
        mode: str = "auto",
        on_progress: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """Cross-encoder scores of ``(query, document)`` pairs ``[N]`` (a one-label head), the query computed once."""
        if self.pooler.num_labels != 1:
            raise PrefillConfigError(
                f"score needs a one-label head (a cross-encoder); this model has num_labels={self.pooler.num_labels}"
            )
        prompts = [self._encode(query, document) for document in documents]
        params = PoolingParams.classify(use_activation=use_activation)
        return torch.stack(self.run(prompts, params, on_progress=on_progress, mode=mode))[:, 0]

    def yes_no_scores(
        self,
        prompts: Sequence[Sequence[int]],
        yes: int,
        no: int,
        *,
        mode: str = "auto",
        share_prefixes: bool = True,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """``P(yes)`` over {no, yes} at each prompt's last token from the LM head (the Qwen3-Reranker recipe)."""
        prompts = [list(p) for p in prompts]
        rows = resolve_rows(PoolingParams.embed(normalize=False), len(prompts), _last_pooler(self.pooler))
        _, logits = self._pooled(prompts, rows, share_prefixes, mode, on_progress, want_logits=True)
        return yes_no_probability(torch.stack(logits), yes, no)

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        instruction: str | None = None,
        mode: str = "auto",
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[tuple[int, float]]:
        """``(document index, score)`` best first: a cross-encoder's ``score``, or the yes/no recipe on a causal LM."""
        if self.pooler.num_labels is not None:
            scores = self.score(query, documents, mode=mode, on_progress=on_progress)
        else:
            tokenizer = self.tokenizer
            if tokenizer is None:
                raise PrefillConfigError("rerank needs a tokenizer")
            yes, no = (tokenizer.convert_tokens_to_ids(t) for t in ("yes", "no"))
            prompts = [self._encode(qwen3_reranker_prompt(query, d, instruction)) for d in documents]
            scores = self.yes_no_scores(prompts, yes, no, mode=mode, on_progress=on_progress)
        order = sorted(range(len(documents)), key=lambda i: -float(scores[i]))
        return [(i, float(scores[i])) for i in order[: top_n or len(order)]]

    def close(self) -> None:
        self.runtime.close()


def _last_pooler(pooler: PoolerConfig) -> PoolerConfig:
    """The pooler with LAST pooling: the yes/no recipe reads the last token whatever the folder pools."""
    import attrs

    return attrs.evolve(pooler, pooling_type=PoolingType.LAST, dimensions=None)
