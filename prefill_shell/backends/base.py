"""The backend seam: every device operation the runtime needs, and nothing else.

A backend moves host values (torch CPU tensors) to its device and back, runs
the few postprocessing ops the runtime owns (last-token gather, argmax,
sampling, log-softmax), and captures/replays traces. Model bodies are not
backend ops: the runtime borrows the model and calls it directly.

Every tensor a backend creates is registered in its ``ledger`` so tests can
prove nothing leaks; ``release`` retires the handle before freeing.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..ledger import DeviceTensor, Ownership, ResourceLedger

__all__ = ["Backend", "TraceHandle", "LogProbs"]


class TraceHandle:
    """A captured trace: its replay callable (backend-specific) and liveness."""

    __slots__ = ("key", "payload", "released")

    def __init__(self, key: str, payload: Any):
        self.key = key
        self.payload = payload
        self.released = False


class LogProbs:
    """Device tensors of one log-prob computation (``[B]``, ``[B, N]``, ``[B, N]``)."""

    __slots__ = ("token_logprob", "top_ids", "top_logprobs")

    def __init__(self, token_logprob: DeviceTensor, top_ids: DeviceTensor | None, top_logprobs: DeviceTensor | None):
        self.token_logprob = token_logprob
        self.top_ids = top_ids
        self.top_logprobs = top_logprobs

    def handles(self) -> list[DeviceTensor]:
        return [h for h in (self.token_logprob, self.top_ids, self.top_logprobs) if h is not None]


@runtime_checkable
class Backend(Protocol):
    """Device operations of the prefill runtime (torch or ttnn)."""

    ledger: ResourceLedger
    device: Any

    # -- memory ---------------------------------------------------------
    def upload(self, host: torch.Tensor, name: str, ownership: Ownership) -> DeviceTensor:
        """Allocates a device tensor holding ``host``."""

    def refresh(self, host: torch.Tensor, target: DeviceTensor) -> None:
        """Copies ``host`` into the existing ``target`` in place (same shape and dtype)."""

    def adopt(self, value: Any, name: str, ownership: Ownership) -> DeviceTensor:
        """Registers a tensor something else produced (a model output) in the ledger."""

    def read(self, handles: list[DeviceTensor]) -> list[torch.Tensor]:
        """Host copies of ``handles``: start every transfer, then synchronize once."""

    def release(self, handle: DeviceTensor) -> None:
        """Frees ``handle``; may raise, leaving the handle live (an orphan to retry)."""

    # -- postprocessing -------------------------------------------------
    def gather_rows(self, hidden: DeviceTensor, index: DeviceTensor, name: str) -> DeviceTensor:
        """``hidden[b, index[b]]`` for every row b: ``[B, S, H] -> [B, H]``."""

    def argmax(self, logits: DeviceTensor, name: str) -> DeviceTensor:
        """Greedy tokens ``[B]`` from logits ``[B, V]``."""

    def sample(self, logits: DeviceTensor, params: tuple, seeds: tuple[int, ...], name: str) -> DeviceTensor:
        """Per-row top-k/top-p/temperature sampling with per-row seeds: ``[B]`` tokens.

        ``params[b]`` is physical row b's ``SamplingParams``; padding rows
        repeat row 0 (a single row's K/P/T is broadcast to the wave).
        """

    def logprobs(self, logits: DeviceTensor, tokens: DeviceTensor, top_n: int, name: str) -> LogProbs:
        """Log-softmax at ``tokens`` and (``top_n > 0``) the top-N table."""

    # -- traces ---------------------------------------------------------
    def capture(self, key: str, body) -> TraceHandle:
        """Captures ``body()`` (which writes only persistent buffers) as a trace."""

    def replay(self, trace: TraceHandle) -> None:
        """Replays ``trace`` against the current contents of its persistent inputs."""

    def release_trace(self, trace: TraceHandle) -> None:
        """Frees ``trace``; replaying it afterwards raises ``PrefillStateError``."""

    def synchronize(self) -> None:
        """Waits until every queued device operation has finished."""
