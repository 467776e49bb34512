"""Fault injection: fail the N-th device call of a chosen kind.

``FaultPlan`` counts calls across a wrapped backend and a wrapped model (one
counter, so "the N-th call" spans the whole run). ``fail_at=None`` only
counts, which is how a test learns how many fault points a run has before
sweeping every one of them. ``raises`` picks what is raised at the fault
point: ``InjectedFault`` (a ``RuntimeError``) by default, or any
``BaseException`` type such as ``KeyboardInterrupt`` (Ctrl-C), which
``except Exception`` clauses do not catch.
"""

from __future__ import annotations

from typing import Any

from prefill_shell.device.ledger import DeviceTensor

from ..backends.base import Backend, TraceHandle

__all__ = ["FAULT_KINDS", "FaultPlan", "InjectedFault", "FaultInjectingBackend", "FaultInjectingModel"]

FAULT_KINDS = ("allocate", "copy", "body", "postprocess", "readback", "release", "capture", "replay")


class InjectedFault(RuntimeError):
    """The error a fault plan raises; tests check it reaches the caller unchanged."""


class FaultPlan:
    """Counts calls of the selected kinds and raises at call number ``fail_at`` (1-based)."""

    def __init__(
        self,
        fail_at: int | None = None,
        kinds: tuple[str, ...] = FAULT_KINDS,
        failing_releases: int = 0,
        raises: type[BaseException] = InjectedFault,
    ):
        unknown = set(kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        if not (isinstance(raises, type) and issubclass(raises, BaseException)):
            raise ValueError(f"raises={raises!r} must be an exception type")
        self.kinds = kinds
        self.raises = raises
        self.log: list[str] = []
        self.arm(fail_at, failing_releases)

    def tick(self, kind: str, what: str) -> None:
        if kind not in self.kinds:
            return
        self.calls += 1
        self.log.append(f"{kind}:{what}")
        if self.calls == self.fail_at:
            self.fired = self.raises(f"injected fault at call {self.calls} ({kind}: {what})")
            raise self.fired
        if kind == "release" and self.fired is not None and self.releases_to_fail > 0:
            # Cleanup after the primary fault fails too: these must become
            # notes on the primary error and orphans for cleanup().
            self.releases_to_fail -= 1
            raise InjectedFault(f"injected release failure ({what})")

    def arm(self, fail_at: int | None, failing_releases: int = 0) -> None:
        """Restarts counting: fail at call ``fail_at`` (None: never), then fail the
        next ``failing_releases`` releases."""
        self.calls, self.fail_at, self.fired = 0, fail_at, None
        self.releases_to_fail = failing_releases
        self.log.clear()


class FaultInjectingBackend:
    """Wraps a ``Backend``; every call first asks the plan whether to fail.

    Every member of the ``Backend`` protocol is written out here, with no
    forwarding of unknown names, so a member the protocol gains fails
    ``tests/testing/test_faults.py`` until it is wrapped (and given a
    fault point where it touches the device). Anything else of the wrapped
    backend is reached through ``inner``.
    """

    def __init__(self, inner: Backend, plan: FaultPlan):
        self.inner = inner
        self.plan = plan
        self.ledger = inner.ledger
        self.device = inner.device
        self.max_device_top_k = inner.max_device_top_k
        self.max_sampled_wave = inner.max_sampled_wave
        self.packed_steps = inner.packed_steps
        self.compiles_programs = inner.compiles_programs

    def preferred_policy(self, block_size: int):
        return self.inner.preferred_policy(block_size)

    def upload(self, host, spec, ownership) -> DeviceTensor:
        self.plan.tick("allocate", spec.name)
        return self.inner.upload(host, spec, ownership)

    def refresh(self, host, target: DeviceTensor) -> None:
        self.plan.tick("copy", target.name)
        self.inner.refresh(host, target)

    def assign(self, target: DeviceTensor, value) -> None:
        self.plan.tick("copy", target.name)
        self.inner.assign(target, value)

    def adopt(self, value, spec, ownership) -> DeviceTensor:
        return self.inner.adopt(value, spec, ownership)

    def read(self, handles: list[DeviceTensor]) -> list:
        self.plan.tick("readback", ",".join(h.name for h in handles))
        return self.inner.read(handles)

    def release(self, handle: DeviceTensor) -> None:
        self.plan.tick("release", handle.name)
        self.inner.release(handle)

    def gather_rows(self, hidden, index):
        self.plan.tick("postprocess", "gather_rows")
        return self.inner.gather_rows(hidden, index)

    def gather_positions(self, hidden, index):
        self.plan.tick("postprocess", "gather_positions")
        return self.inner.gather_positions(hidden, index)

    def argmax(self, logits):
        self.plan.tick("postprocess", "argmax")
        return self.inner.argmax(logits)

    def sample(self, logits, inputs, seeds):
        self.plan.tick("postprocess", "sample")
        return self.inner.sample(logits, inputs, seeds)

    def logprobs(self, logits, tokens, top_n):
        self.plan.tick("postprocess", "logprobs")
        return self.inner.logprobs(logits, tokens, top_n)

    def capture(self, key: str, body) -> TraceHandle:
        self.plan.tick("capture", key)
        return self.inner.capture(key, body)

    def replay(self, trace: TraceHandle) -> None:
        self.plan.tick("replay", trace.key)
        self.inner.replay(trace)

    def release_trace(self, trace: TraceHandle) -> None:
        self.plan.tick("release", trace.key)
        self.inner.release_trace(trace)


class FaultInjectingModel:
    """Wraps a ``PrefillModel``; the hidden body and the LM head are fault points."""

    def __init__(self, inner: Any, plan: FaultPlan):
        self.inner = inner
        self.plan = plan
        self.spec = inner.spec
        self.dtype = inner.dtype
        self.packed_steps = getattr(inner, "packed_steps", False)

    def forward_hidden(self, tokens, start, fill_table, read_table, kv):
        self.plan.tick("body", f"forward_hidden[{tokens.shape[0]}x{tokens.shape[1]}]")
        return self.inner.forward_hidden(tokens, start, fill_table, read_table, kv)

    def forward_packed(self, tokens, positions, write_slots, segments, prefix_table, kv):
        self.plan.tick("body", f"forward_packed[{tokens.shape[0]}]")
        return self.inner.forward_packed(tokens, positions, write_slots, segments, prefix_table, kv)

    def lm_head(self, rows):
        self.plan.tick("body", "lm_head")
        return self.inner.lm_head(rows)
