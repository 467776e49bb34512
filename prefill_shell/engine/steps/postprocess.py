"""``PrefillPostprocessor``: final hidden output -> readable result values.

It owns the boundary between the model body and the host read: pick each
row's last-token hidden state, apply the LM head, then logits, argmax or
device top-k sampling, and log-probs. It never reorders rows and never reads
to the host; that is the result collector's job.

Ownership is decided here. Eager: every output is a new invocation-owned
tensor. Traced: every output is assigned into the program alias's
persistent workspace (allocated at warm-up, before any capture), so serving
allocates nothing and the next replay overwrites the same buffers.

Device top-k sampling reads K, P and T as device tensors
(``contract.SAMPLING_INPUTS``, values from ``contract.sampling_values``),
handed to ``Backend.sample`` as a mapping keyed by spec:
eager, they are uploaded once per invocation as invocation-owned tensors,
released with the invocation's other transients; traced, they are refreshed
in place into the workspace's persistent copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefill_core import PrefillProgramSignature, PreparedPrefill, SamplingPath
from prefill_shell.backends.base import Backend
from prefill_shell.device.contract import (
    LAST_HIDDEN,
    LOGITS,
    SAMPLED_TOKENS,
    SAMPLING_INPUTS,
    TOKEN_LOGPROB,
    TOP_IDS,
    TOP_LOGPROBS,
    TensorSpec,
    sampling_values,
)
from prefill_shell.device.ledger import DeviceTensor, Ownership

__all__ = ["PrefillPostprocessor", "wave_params"]


def wave_params(prepared: PreparedPrefill) -> tuple:
    """Per physical row sampling params; padding rows repeat row 0 (broadcast).

    Computed once per invocation, by the runtime, for either mode.
    """
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
        physical row (``wave_params``). Eager outputs, and the top-k path's
        K/P/T inputs, are appended to ``acquired``; traced outputs are written
        into ``workspace``, whose K/P/T are refreshed in place first.
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
            inputs = self._sampling_inputs(params, acquired, workspace)
            values = {spec: handle.value for spec, handle in inputs.items()}
            tokens = emit(SAMPLED_TOKENS, backend.sample(logits.value, values, seeds))
        top_n = self.max_logprobs if signature.logprobs else 0
        token_lp, top_ids, top_values = backend.logprobs(logits.value, tokens.value, top_n)
        outputs = {SAMPLED_TOKENS: tokens, TOKEN_LOGPROB: emit(TOKEN_LOGPROB, token_lp)}
        if top_ids is not None:
            outputs[TOP_IDS] = emit(TOP_IDS, top_ids)
            outputs[TOP_LOGPROBS] = emit(TOP_LOGPROBS, top_values)
        return outputs

    def _sampling_inputs(
        self, params: tuple, acquired: list[DeviceTensor], workspace: dict[TensorSpec, DeviceTensor] | None
    ) -> dict[TensorSpec, DeviceTensor]:
        """``SAMPLING_INPUTS`` on the device: refreshed into the workspace (traced) or uploaded for this invocation."""
        host = sampling_values(params)
        handles = {}
        for spec in SAMPLING_INPUTS:
            if workspace is not None:
                self.backend.refresh(host[spec], workspace[spec])
                handles[spec] = workspace[spec]
            else:
                handles[spec] = self.backend.upload(host[spec], spec, Ownership.INVOCATION)
                acquired.append(handles[spec])  # owned by the invocation from the moment it exists
        return handles
