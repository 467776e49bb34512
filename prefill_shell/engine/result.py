"""Result values handed to the caller: one ``PrefillResult`` per source row, or one ``BatchResult`` per call."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from prefill_core import PreparedPrefill
from prefill_core.values.errors import PrefillStateError
from prefill_shell.device.ledger import DeviceTensor

__all__ = ["BatchResult", "InvocationResult", "InvocationState", "PrefillResult"]


def _same_logits(a: Any, b: Any) -> bool:
    """Logits compare by value (shape, dtype and every element; NaN equals NaN)."""
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def _nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: rows of ``logits [B, V]`` holding NaN or +inf (softmax over them is undefined)."""
    return (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)


class PrefillResult(NamedTuple):
    """The prefill output of one caller row: an immutable value.

    ``logits`` (float32 ``[V]``, a host copy the caller owns) when the row
    asked for no sampling; otherwise ``token``, its ``logprob`` under the
    model's raw distribution, and ``top_logprobs``: the row's
    ``num_logprobs`` best ``(token, logprob)``. ``prompt_logprobs``: when the
    row asked for them (``SamplingParams.prompt_logprobs``), one
    ``prompt_logprobs.PromptLogprob`` per scored prompt token, in position
    order. Results compare with ``==``
    (logits by value), so eager and traced results can be compared directly.
    A named tuple rather than a frozen attrs class: the assembler builds one
    per row of every call, and a tuple is the cheapest immutable value.
    """

    row: int
    logits: Any = None
    token: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: tuple = ()
    pooled: Any = None  # float32 [hidden]: the row's final hidden states pooled (PrefillCall.pooling)

    @property
    def nonfinite(self) -> bool:
        """Whether the row's last-token logits held NaN or +inf (a float16 overflow, say): then its token
        (whatever an argmax or draw over them gave, often 0) and its log-probs mean nothing.

        Read from what the row holds: its logits, or its sampled token's log-prob, which is NaN exactly
        when the logits held NaN or +inf (or were all -inf). Every other row of the call is unaffected.
        """
        if self.logits is not None:
            return _nonfinite_rows(self.logits.reshape(1, -1)).item()
        return self.logprob is not None and self.logprob != self.logprob  # NaN

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrefillResult):
            return NotImplemented
        return self[0] == other[0] and self[2:] == other[2:] and _same_logits(self[1], other[1])

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:  # logits are left out: equal results hash alike
        return hash((self[0], *self[2:]))


class BatchResult(NamedTuple):
    """A whole call's outputs as caller-ordered tensors (``PrefillExecutor.prefill(..., batched=True)``).

    ``tokens`` int64 ``[B]`` and ``logprobs`` float32 ``[B]`` (the sampled
    token's raw log-prob) hold the rows that sampled: -1 and NaN in rows that
    returned logits. ``logits`` float32 ``[B, V]`` holds the rows that asked
    for no sampling (NaN in the others), or is None when no row did. Row ``r``
    holds exactly what ``PrefillResult`` ``r`` of ``prefill`` would hold.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    logits: torch.Tensor | None = None

    @property
    def nonfinite(self) -> torch.Tensor:
        """bool ``[B]``: row ``r`` is ``PrefillResult.nonfinite`` of row ``r`` (NaN or +inf logits)."""
        sampled = self.tokens >= 0
        flags = sampled & torch.isnan(self.logprobs)
        if self.logits is not None:
            flags |= ~sampled & _nonfinite_rows(self.logits)
        return flags

    @classmethod
    def from_results(cls, results: Sequence[PrefillResult]) -> BatchResult:
        """The same call's per-row results (in caller order, none asking top or prompt log-probs) as tensors."""
        rows = range(len(results))
        tokens = torch.tensor([-1 if r.logits is not None else r.token for r in results], dtype=torch.int64)
        nan = float("nan")
        logprobs = torch.tensor([nan if r.logits is not None else r.logprob for r in results], dtype=torch.float32)
        kept = [row for row in rows if results[row].logits is not None]
        if not kept:
            return cls(tokens, logprobs)
        width = results[kept[0]].logits.shape[0]
        logits = torch.full((len(results), width), nan, dtype=torch.float32)
        logits[kept] = torch.stack([results[row].logits for row in kept]).float()
        return cls(tokens, logprobs, logits)


class InvocationState(enum.Enum):
    """Where an invocation is in its life: produced, read by the assembler, or released unread."""

    PENDING = "pending"
    ASSEMBLED = "assembled"
    RELEASED = "released"


class InvocationResult:
    """One request's device outputs plus the transients that stay owned until collection.

    Lifetime: an invocation is read once, by ``assemble`` or ``stream``.
    ``owned`` are the eager outputs and transients, released by that read or,
    when it is never read, by the runtime's ``cleanup()`` / ``close()``
    (state ``RELEASED``). A traced invocation owns nothing: its outputs sit
    in its program alias's workspace (``workspace``), which the next traced
    invocation of that alias overwrites, so it is readable only while the
    workspace's generation is still the one it claimed.
    """

    __slots__ = ("prepared", "outputs", "owned", "seeds", "state", "workspace", "generation", "prompt", "steps")

    def __init__(
        self,
        prepared: PreparedPrefill,
        outputs: dict,
        owned: list[DeviceTensor],
        seeds: tuple[int, ...],
        workspace: Any = None,
        generation: int = 0,
        prompt: dict[int, tuple] | None = None,
        steps: Any = None,
    ):
        self.prepared = prepared
        self.outputs = outputs
        self.owned = owned
        self.seeds = seeds
        self.state = InvocationState.PENDING
        self.workspace = workspace  # a trace.AliasWorkspace for a traced invocation, else None
        self.generation = generation
        self.prompt = prompt  # caller row -> its PromptLogprob entries, in position order (host values)
        self.steps = steps  # the partial_writes.StepLog its steps ran from (None: none kept)

    def unfinished_writes(self) -> dict[int, tuple[int, ...]]:
        """Blocks this request's steps wrote for rows a later request returns (packed steps), by caller row.

        Such a row is partly written until that request runs: a call that
        stops after this request (a failed read) leaves it so.
        """
        if self.steps is None:
            return {}
        rows = self.prepared.request.source_rows
        return {row: blocks for row, blocks in self.steps.written_blocks(rows).items() if row not in rows}

    def check_readable(self) -> None:
        """Raises ``PrefillStateError`` unless this invocation's outputs are still its own and unread."""
        rows = self.prepared.request.source_rows
        if self.state is InvocationState.ASSEMBLED:
            raise PrefillStateError(f"the invocation of rows {rows} was already assembled")
        if self.state is InvocationState.RELEASED:
            raise PrefillStateError(
                f"the invocation of rows {rows} was released unread by cleanup() or close(); its outputs are "
                "gone: invoke the request again"
            )
        workspace = self.workspace
        if workspace is not None and (workspace.released or workspace.generation != self.generation):
            why = "were released with the traces" if workspace.released else "were overwritten by a later replay"
            raise PrefillStateError(
                f"the traced invocation of rows {rows} cannot be read: its outputs in the program alias's workspace "
                f"{why}; read each traced invocation before the next traced invoke"
            )
