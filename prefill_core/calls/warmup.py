"""What a warm-up will cost, decided before it starts: the bodies it runs, the positions they compute, the
persistent bytes it leaves, and the lengths it is limited to.

A warm-up (``PrefillExecutor.warm_up``) has two stages that run model bodies:

* **compile**: one eager run per program signature, so a device builds the
  programs before serving. A backend that builds nothing per shape (torch on
  the CPU: ``Backend.compiles_programs`` is False) has nothing to gain from
  these runs, so only the smallest runs there, once (``programs_to_compile``). Packed
  programs are never run ahead (eager only, shaped by each step);
* **capture**: one trace per trace signature, each running its body once
  (CUDA graphs run it twice: a warm run, then the capture).

Persistent bytes are what the warm-up leaves allocated: each trace's body
inputs and hidden output, and each program alias's postprocessing workspace
(``prefill_shell.device.contract``'s shapes, by formula here; the suite
checks the formula against the ledger). ``limited_to(manifest, lengths)``
keeps only the identities of the given invocation lengths, as
tt-transformers' ``WarmupConfig.prefill_seq_lens`` limits a warm-up to a
workload's lengths; a traced call of any other length is then refused by
name (``TraceCoverageError``), never run eagerly.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from prefill_core.calls.manifest import WarmupManifest
from prefill_core.planning.request import RequestKind
from prefill_core.planning.signatures import PrefillProgramSignature, PrefillTraceSignature
from prefill_core.values.errors import PrefillInputError, field_error
from prefill_core.values.sampling import SamplingPath

__all__ = ["ModelGeometry", "WarmupCost", "limited_to", "programs_to_compile", "warmup_cost"]

_INT64, _INT32, _FLOAT64, _FLOAT32 = 8, 4, 8, 4


@attrs.frozen
class ModelGeometry:
    """The model sizes a warm-up's persistent buffers depend on; ``dtype_bytes``: one hidden-state element."""

    hidden_size: int
    vocab_size: int
    dtype_bytes: int
    max_logprobs: int = 20


@attrs.frozen
class WarmupCost:
    """Bodies each stage runs, the positions they compute, and the bytes left allocated after it."""

    compile_bodies: int
    compile_positions: int
    capture_bodies: int
    capture_positions: int
    workspaces: int
    persistent_bytes: int

    def __str__(self) -> str:
        return (
            f"compile {self.compile_bodies} bodies ({self.compile_positions} positions), "
            f"capture {self.capture_bodies} traces ({self.capture_positions} positions), "
            f"{self.workspaces} workspaces, {self.persistent_bytes} persistent bytes"
        )


def programs_to_compile(manifest: WarmupManifest, compiles_programs: bool) -> tuple[PrefillProgramSignature, ...]:
    """The program signatures a warm-up runs eagerly: every one where a program is built per shape; where
    nothing is, only the smallest, whose one run pays the process's one-time start-up (thread pools, the
    allocator, dispatch tables) so that no first call of a shape pays it."""
    runnable = tuple(s for s in manifest.program_signatures if s.variant is not RequestKind.PACKED)
    if compiles_programs or not runnable:
        return runnable
    return (min(runnable, key=lambda s: (s.padded_batch * s.invocation_length, s.key)),)


def aliases_to_allocate(manifest: WarmupManifest) -> tuple[PrefillProgramSignature, ...]:
    """The program signatures whose postprocessing workspace a warm-up allocates (those of captured bodies)."""
    captured = set(manifest.trace_signatures)
    return tuple(s for s in manifest.program_signatures if s.body in captured)


def limited_to(manifest: WarmupManifest, lengths: Iterable[int]) -> WarmupManifest:
    """``manifest`` with only the programs and traces of the given invocation lengths.

    A length the manifest does not hold is a ``PrefillInputError`` naming it
    and the lengths it holds (a typo must not warm nothing).
    """
    wanted = set(lengths)
    held = {s.invocation_length for s in manifest.program_signatures} | {
        s.chunk_length for s in manifest.trace_signatures
    }
    missing = sorted(wanted - held)
    if missing:
        rule = f"must be lengths the manifest holds ({sorted(held)})"
        raise field_error(PrefillInputError, "limited_to", "lengths", missing, rule)
    return WarmupManifest(
        tuple(s for s in manifest.program_signatures if s.invocation_length in wanted),
        tuple(s for s in manifest.trace_signatures if s.chunk_length in wanted),
    )


def _trace_bytes(body: PrefillTraceSignature, model: ModelGeometry) -> int:
    """A trace's persistent inputs (tokens, start, slots, fill and read tables) and its hidden output."""
    b, s = body.padded_batch, body.chunk_length
    inputs = b * s * _INT64 + b * _INT64 + b * _INT32 + b * (body.page_table_width + body.read_table_width) * _INT32
    return inputs + b * s * model.hidden_size * model.dtype_bytes


def _workspace_bytes(signature: PrefillProgramSignature, model: ModelGeometry) -> int:
    """A program alias's last-token index, sampling inputs (top-k), last hidden row, logits and sampled outputs."""
    b, path = signature.padded_batch, signature.sampling_path
    size = b * _INT64 + b * model.hidden_size * model.dtype_bytes + b * model.vocab_size * _FLOAT32
    if path is SamplingPath.TOPK:
        size += b * (_INT64 + 2 * _FLOAT64)
    if not path.returns_logits:
        size += b * (_INT64 + _FLOAT32)
        if signature.logprobs:
            size += b * model.max_logprobs * (_INT64 + _FLOAT32)
    return size


def warmup_cost(manifest: WarmupManifest, model: ModelGeometry, *, compiles_programs: bool = True) -> WarmupCost:
    """What warming ``manifest`` runs and keeps (``compiles_programs``: the backend builds programs per shape)."""
    if not isinstance(manifest, WarmupManifest):
        raise field_error(PrefillInputError, "warmup_cost", "manifest", manifest, "must be a WarmupManifest")
    compiled = programs_to_compile(manifest, compiles_programs)
    aliases = {(s.padded_batch, s.sampling_path, s.logprobs): s for s in aliases_to_allocate(manifest)}
    traces = manifest.trace_signatures
    return WarmupCost(
        len(compiled),
        sum(s.padded_batch * s.invocation_length for s in compiled),
        len(traces),
        sum(t.padded_batch * t.chunk_length for t in traces),
        len(aliases),
        sum(_trace_bytes(t, model) for t in traces) + sum(_workspace_bytes(s, model) for s in aliases.values()),
    )
