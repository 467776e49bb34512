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

from prefill_core import PreparedPrefill, PrefillProgramSignature, SamplingPath

from .backends.base import Backend
from .contract import LAST_HIDDEN, LOGITS, SAMPLED_TOKENS, TOKEN_LOGPROB, TOP_IDS, TOP_LOGPROBS, TensorSpec
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
        self,
        signature: PrefillProgramSignature,
        params: tuple,
        hidden: DeviceTensor,
        last_index: DeviceTensor,
        seeds: tuple[int, ...],
        acquired: list[DeviceTensor],
        workspace: dict[TensorSpec, DeviceTensor] | None = None,
    ) -> dict[TensorSpec, DeviceTensor]:
        """The program's outputs (``contract.output_specs``) for the assembler.

        Logits paths (``logits``, ``host``) return ``LOGITS``; device paths
        return ``SAMPLED_TOKENS``, ``TOKEN_LOGPROB`` and, when the program
        computes log-probs, ``TOP_IDS`` / ``TOP_LOGPROBS``. ``params`` are per
        physical row (``wave_params``). Eager outputs are appended to
        ``acquired``; traced ones are written into ``workspace``.
        """
        backend = self.backend

        def emit(spec: TensorSpec, value: Any) -> DeviceTensor:
            if workspace is not None:
                backend.assign(workspace[spec], value)
                return workspace[spec]
            handle = backend.adopt(value, spec, Ownership.INVOCATION)
            acquired.append(handle)
            return handle

        rows = emit(LAST_HIDDEN, backend.gather_rows(hidden.value, last_index.value))  # [B, H]
        logits = emit(LOGITS, self._lm_head(rows.value))  # [B, V] float32
        path = signature.sampling_path
        if path.returns_logits:
            return {LOGITS: logits}
        if path is SamplingPath.ARGMAX:
            tokens = emit(SAMPLED_TOKENS, backend.argmax(logits.value))
        else:
            tokens = emit(SAMPLED_TOKENS, backend.sample(logits.value, params, seeds))
        top_n = self.max_logprobs if signature.logprobs else 0
        token_lp, top_ids, top_values = backend.logprobs(logits.value, tokens.value, top_n)
        outputs = {SAMPLED_TOKENS: tokens, TOKEN_LOGPROB: emit(TOKEN_LOGPROB, token_lp)}
        if top_ids is not None:
            outputs[TOP_IDS] = emit(TOP_IDS, top_ids)
            outputs[TOP_LOGPROBS] = emit(TOP_LOGPROBS, top_values)
        return outputs
