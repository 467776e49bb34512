"""``PrefillPostprocessor``: final hidden output -> readable result values.

It owns the boundary between the model body and the host read: pick each
row's last-token hidden state, apply the LM head, then logits, argmax or
device top-k sampling, and log-probs. It never reorders rows and never reads
to the host; that is the result collector's job.
"""

from __future__ import annotations

from collections.abc import Callable

from prefill_core import PreparedPrefill, SamplingPath

from .backends.base import Backend
from .ledger import DeviceTensor, Ownership

__all__ = ["PrefillPostprocessor", "wave_params"]


def wave_params(prepared: PreparedPrefill) -> tuple:
    """Per physical row sampling params; padding rows repeat row 0 (broadcast)."""
    request = prepared.request
    params = request.sampling
    return params + (params[0],) * (request.padded_batch - request.active_batch_size)


class PrefillPostprocessor:
    """Turns the final hidden output of a request into named output tensors."""

    def __init__(self, backend: Backend, lm_head: Callable, max_logprobs: int):
        self.backend = backend
        self._lm_head = lm_head
        self.max_logprobs = max_logprobs

    def finish(
        self, prepared: PreparedPrefill, hidden: DeviceTensor, last_index: DeviceTensor, seeds: tuple[int, ...],
        acquired: list[DeviceTensor],
    ) -> dict[str, DeviceTensor]:
        """Named outputs for the collector; every handle made is appended to ``acquired``.

        Logits paths (``logits``, ``host``) return ``logits [B, V]``; device
        paths return ``tokens [B]``, ``token_logprob [B]`` and, when the
        program computes log-probs, ``top_ids``/``top_logprobs [B, N]``.
        """
        backend = self.backend
        rows = backend.gather_rows(hidden, last_index, "last_hidden")  # [B, H]
        acquired.append(rows)
        logits = backend.adopt(self._lm_head(rows.value), "logits", Ownership.INVOCATION)  # [B, V]
        acquired.append(logits)
        path = prepared.sampling_path
        if path.returns_logits:
            return {"logits": logits}
        if path is SamplingPath.ARGMAX:
            tokens = backend.argmax(logits, "tokens")
        else:
            tokens = backend.sample(logits, wave_params(prepared), seeds, "tokens")
        acquired.append(tokens)
        top_n = self.max_logprobs if prepared.program_signature.logprobs else 0
        logprobs = backend.logprobs(logits, tokens, top_n, "logprobs")
        acquired.extend(logprobs.handles())
        outputs = {"tokens": tokens, "token_logprob": logprobs.token_logprob}
        if logprobs.top_ids is not None:
            outputs["top_ids"] = logprobs.top_ids
            outputs["top_logprobs"] = logprobs.top_logprobs
        return outputs
