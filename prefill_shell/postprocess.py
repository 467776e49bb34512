"""``PrefillPostprocessor``: final hidden output -> readable result values.

It owns the boundary between the model body and the host read: pick each
row's last-token hidden state, apply the LM head, then logits, argmax or
device top-k sampling, and log-probs. It never reorders rows and never reads
to the host; that is the result collector's job.

Ownership is decided here. Eager: every output is a new invocation-owned
tensor. Traced: every output is assigned into the program alias's
persistent workspace (allocated at warm-up, before any capture), so serving
allocates nothing and the next replay overwrites the same buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from prefill_core import PreparedPrefill, PrefillProgramSignature, SamplingPath

from .backends.base import Backend
from .ledger import DeviceTensor, Ownership

__all__ = ["PrefillPostprocessor", "wave_params", "output_specs"]


def wave_params(prepared: PreparedPrefill) -> tuple:
    """Per physical row sampling params; padding rows repeat row 0 (broadcast)."""
    request = prepared.request
    params = request.sampling
    return params + (params[0],) * (request.padded_batch - request.active_batch_size)


def output_specs(signature: PrefillProgramSignature, hidden_size: int, vocab_size: int, max_logprobs: int,
                 hidden_dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor the postprocessing of ``signature`` produces."""
    b = signature.padded_batch
    specs = {"last_index": ((b,), torch.int64), "last_hidden": ((b, hidden_size), hidden_dtype),
             "logits": ((b, vocab_size), torch.float32)}
    if not signature.sampling_path.returns_logits:
        specs.update(tokens=((b,), torch.int64), token_logprob=((b,), torch.float32))
        if signature.logprobs:
            specs.update(top_ids=((b, max_logprobs), torch.int64), top_logprobs=((b, max_logprobs), torch.float32))
    return specs


class PrefillPostprocessor:
    """Turns the final hidden output of a request into named output tensors."""

    def __init__(self, backend: Backend, lm_head: Callable, max_logprobs: int):
        self.backend = backend
        self._lm_head = lm_head
        self.max_logprobs = max_logprobs

    def finish(
        self,
        signature: PrefillProgramSignature,
        params: tuple,
        hidden: DeviceTensor,
        last_index: DeviceTensor,
        seeds: tuple[int, ...],
        acquired: list[DeviceTensor],
        workspace: dict[str, DeviceTensor] | None = None,
    ) -> dict[str, DeviceTensor]:
        """Named outputs for the collector.

        Logits paths (``logits``, ``host``) return ``logits [B, V]``; device
        paths return ``tokens [B]``, ``token_logprob [B]`` and, when the
        program computes log-probs, ``top_ids``/``top_logprobs [B, N]``.
        ``params`` are per physical row (``wave_params``). Eager outputs are
        appended to ``acquired``; traced ones live in ``workspace``.
        """
        backend = self.backend

        def emit(name: str, value: Any) -> DeviceTensor:
            if workspace is not None:
                backend.assign(workspace[name], value)
                return workspace[name]
            handle = backend.adopt(value, name, Ownership.INVOCATION)
            acquired.append(handle)
            return handle

        rows = emit("last_hidden", backend.gather_rows(hidden.value, last_index.value))  # [B, H]
        logits = emit("logits", self._lm_head(rows.value))  # [B, V] float32
        path = signature.sampling_path
        if path.returns_logits:
            return {"logits": logits}
        if path is SamplingPath.ARGMAX:
            tokens = emit("tokens", backend.argmax(logits.value))
        else:
            tokens = emit("tokens", backend.sample(logits.value, params, seeds))
        top_n = self.max_logprobs if signature.logprobs else 0
        token_lp, top_ids, top_values = backend.logprobs(logits.value, tokens.value, top_n)
        outputs = {"tokens": tokens, "token_logprob": emit("token_logprob", token_lp)}
        if top_ids is not None:
            outputs["top_ids"] = emit("top_ids", top_ids)
            outputs["top_logprobs"] = emit("top_logprobs", top_values)
        return outputs
