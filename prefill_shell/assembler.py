"""``PrefillResultAssembler``: streaming readback in the caller's row order.

For each invocation, in stream order: one synchronized read of every output,
host-side sampling for ``host``-path rows, then release of that invocation's
transients, and only then is the next invocation pulled from the stream.
Streaming is what makes trace replay safe: a replay may overwrite a shared
output buffer, so a result must be a host copy before the generator advances.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator

import torch

from prefill_core import SamplingPath
from prefill_core.errors import PrefillStateError

from .backends.base import Backend
from .contract import LOGITS, SAMPLED_TOKENS, TOKEN_LOGPROB, TOP_IDS, TOP_LOGPROBS, TensorSpec
from .result import InvocationResult, PrefillResult
from .torch_sampling import sample_row, top_logprobs

__all__ = ["PrefillResultAssembler", "result_record"]

result_record = functools.partial(tuple.__new__, PrefillResult)
"""``result_record((row, logits, token, logprob, top_logprobs, prompt_logprobs))``: a ``PrefillResult`` of all six.

One C call per row where ``PrefillResult(row, token=..., logprob=...)``
parses keywords in Python (``benchmarks/host_forms.py``, row
``result_record``); the assembler builds one per row of every call.
"""


class PrefillResultAssembler:
    """Reads, normalizes and releases invocation results one at a time."""

    def __init__(self, backend: Backend, release: Callable[..., None]):
        self.backend = backend
        self._release = release

    def stream(self, invocations: Iterable[InvocationResult]) -> Iterator[PrefillResult]:
        """Yields each source row's result as its invocation is read (plan order)."""
        for invocation in invocations:
            yield from self._collect_one(invocation)

    def assemble(self, invocations: Iterable[InvocationResult], num_rows: int) -> list[PrefillResult]:
        """Every row's result, in the caller's row order."""
        results: list[PrefillResult | None] = [None] * num_rows
        for result in self.stream(invocations):
            results[result.row] = result
        missing = [row for row, result in enumerate(results) if result is None]
        if missing:
            raise PrefillStateError(f"no result was produced for rows {missing}")
        return results  # type: ignore[return-value]

    def _collect_one(self, invocation: InvocationResult) -> list[PrefillResult]:
        if invocation.consumed:
            raise PrefillStateError("this invocation result was already assembled")
        invocation.consumed = True
        specs = list(invocation.outputs)
        try:
            host = dict(zip(specs, self.backend.read([invocation.outputs[s] for s in specs])))
        except BaseException as primary:
            # Release failures ride on the read error as notes, never replace it.
            self._release(invocation.owned, primary=primary)
            raise
        self._release(invocation.owned)
        results = self._normalize(invocation, host)
        if invocation.prompt is None:
            return results
        return [r._replace(prompt_logprobs=tuple(invocation.prompt.get(b, ()))) for b, r in enumerate(results)]

    def _normalize(self, invocation: InvocationResult, host: dict[TensorSpec, torch.Tensor]) -> list[PrefillResult]:
        prepared = invocation.prepared
        request = prepared.request
        if prepared.sampling_path is SamplingPath.HOST:
            host = self._sample_on_host(invocation, host[LOGITS])
        if prepared.sampling_path is SamplingPath.LOGITS:
            rows = zip(request.source_rows, host[LOGITS].unbind(0))
            return [result_record((row, logits, None, None, (), ())) for row, logits in rows]
        tokens, token_lp = host[SAMPLED_TOKENS].tolist(), host[TOKEN_LOGPROB].tolist()
        if TOP_IDS not in host:  # no row of the wave asked for top log-probs
            rows = zip(request.source_rows, tokens, token_lp)
            return [result_record((row, None, token, logprob, (), ())) for row, token, logprob in rows]
        top_ids, top_values = host[TOP_IDS].tolist(), host[TOP_LOGPROBS].tolist()
        results = []
        for b, row in enumerate(request.source_rows):
            n = request.sampling[b].num_logprobs
            top = tuple(zip(top_ids[b][:n], top_values[b][:n])) if n else ()
            results.append(result_record((row, None, tokens[b], token_lp[b], top, ())))
        return results

    @staticmethod
    def _sample_on_host(invocation: InvocationResult, logits: torch.Tensor) -> dict[TensorSpec, torch.Tensor]:
        """The ``host`` path: device returned logits; sample here with each row's seed."""
        request = invocation.prepared.request
        active = logits[: request.active_batch_size]
        tokens = torch.stack(
            [
                sample_row(active[b], p.top_k, p.top_p, p.temperature, invocation.seeds[b])
                for b, p in enumerate(request.sampling)
            ]
        )
        top_n = max(p.num_logprobs for p in request.sampling)
        token_lp, ids, values = top_logprobs(active, tokens, top_n)
        host = {SAMPLED_TOKENS: tokens, TOKEN_LOGPROB: token_lp}
        if ids is not None:
            host.update({TOP_IDS: ids, TOP_LOGPROBS: values})
        return host
