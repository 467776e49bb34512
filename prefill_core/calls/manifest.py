"""The warm-up manifest: every identity a policy can produce, enumerated.

``manifest_for`` walks the length buckets of a layout's capacity and, per
bucket, the variants the planner can pick (regular single and each batched
wave when the bucket's rung fits the max chunk; one chunked body per chunk
length a row of the bucket can reach, and, with ``batch_cached_rows``, each
chunked wave of a one-step chunk length), crossed with sampling paths and
log-prob settings. A chunked row's chunk comes from the rung of its
work (from the start of the block holding its cached offset), so a bucket
reaches the chunk of every rung of ``1 .. longest - block_size`` tokens
(rows cached past their first block), its own rung's chunk (uncached rows
when it exceeds the max chunk; rows cached inside their first block, which
recompute their whole length, always), and the fully cached re-run step. A
chunked body's read width is the layout's for its chunk length, so buckets
that reach one chunk length share its body. It uses
the planner's own geometry rules (``geometry.py``, ``PrefillPolicy``), which
is what makes it complete: warming every entry leaves nothing to compile at
serving time. ``observe`` instead records what a real workload used.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs

from prefill_core.kv_groups.attention_layout import AttentionLayout
from prefill_core.kv_groups.group_tables import body_groups
from prefill_core.planning.geometry import chunked_fill_width, chunked_read_width, regular_table_width
from prefill_core.planning.prepared import PreparedPrefill
from prefill_core.planning.request import RequestKind
from prefill_core.planning.signatures import PrefillProgramSignature, PrefillTraceSignature
from prefill_core.values.errors import PrefillInputError, field_error
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy, check_policy_fits_layout
from prefill_core.values.sampling import SamplingPath
from prefill_core.values.serialize import from_json, to_json

__all__ = ["WarmupManifest", "manifest_for", "length_buckets", "reachable_chunks"]

ALL_PATHS = tuple(SamplingPath)


def _sorted_unique(values: Iterable) -> tuple:
    return tuple(sorted(set(values), key=lambda s: s.key))


@attrs.frozen
class WarmupManifest:
    """Program and trace identities to compile and capture before serving."""

    program_signatures: tuple[PrefillProgramSignature, ...] = ()
    trace_signatures: tuple[PrefillTraceSignature, ...] = ()

    def covers(self, prepared: PreparedPrefill) -> bool:
        """Whether warming this manifest leaves nothing to build for ``prepared``."""
        if prepared.program_signature not in self.program_signatures:
            return False
        return prepared.trace_signature is None or prepared.trace_signature in self.trace_signatures

    def observe(self, prepared: Iterable[PreparedPrefill]) -> WarmupManifest:
        """A manifest that also holds every identity ``prepared`` used."""
        items = tuple(prepared)
        programs = self.program_signatures + tuple(p.program_signature for p in items)
        traces = self.trace_signatures + tuple(p.trace_signature for p in items if p.trace_signature is not None)
        return WarmupManifest(_sorted_unique(programs), _sorted_unique(traces))

    def to_json(self) -> str:
        return to_json(self, indent=1)

    @classmethod
    def from_json(cls, text: str) -> WarmupManifest:
        return from_json(cls, text)


def length_buckets(policy: PrefillPolicy, max_length: int) -> Iterator[tuple[int, int, int]]:
    """``(padded_length, shortest, longest)`` for every bucket of lengths 1..max_length."""
    shortest = 1
    while shortest <= max_length:
        padded = policy.padded_length(shortest)
        yield padded, shortest, min(padded, max_length)
        shortest = padded + 1


def reachable_chunks(policy: PrefillPolicy, block_size: int, padded: int, shortest: int, longest: int) -> set[int]:
    """Chunk lengths a chunked row of ``shortest..longest`` tokens (rung ``padded``) can run."""
    chunks = set()
    # Uncached rows run chunked when the rung exceeds the max chunk; a row of
    # two or more tokens cached inside its first block (1 <= cached < block_size)
    # recomputes from 0, so its work is its whole length, of this bucket's rung.
    if padded > policy.max_chunk_length or min(longest, block_size) > 1:
        chunks.add(policy.chunk_length(padded, block_size))
    # A row cached past its first block leaves 1 .. longest - block_size
    # tokens of work; a bucket spans at least one block, so every such count occurs.
    for work, _, _ in length_buckets(policy, longest - block_size):
        chunks.add(policy.chunk_length(work, block_size))
    if longest // block_size * block_size >= shortest:  # a block-aligned length can be fully cached
        chunks.add(policy.fully_cached_step(block_size))
    return chunks


def _bodies(policy: PrefillPolicy, layout: PageTableLayout) -> Iterator[tuple[PrefillTraceSignature, int, int]]:
    """Every hidden-body geometry, with the bucket's (shortest, longest) lengths."""
    bs = layout.block_size
    for padded, shortest, longest in length_buckets(policy, layout.capacity):
        if padded <= policy.max_chunk_length:
            width = regular_table_width(policy, bs, padded)
            yield PrefillTraceSignature(RequestKind.REGULAR_SINGLE, 1, padded, width, 0), shortest, longest
            for wave in _wave_sizes(policy, padded):
                yield PrefillTraceSignature(RequestKind.REGULAR_BATCHED, wave, padded, width, 0), shortest, longest
        for chunk in sorted(reachable_chunks(policy, bs, padded, shortest, longest)):
            read = chunked_read_width(policy, layout, chunk)
            fill = chunked_fill_width(policy, bs, chunk)
            yield PrefillTraceSignature(RequestKind.CHUNKED, 1, chunk, fill, read), shortest, longest
            for wave in _wave_sizes(policy, chunk) if policy.batch_cached_rows else ():
                yield PrefillTraceSignature(RequestKind.CHUNKED, wave, chunk, fill, read), shortest, longest


def _wave_sizes(policy: PrefillPolicy, step_length: int) -> list[int]:
    """Padded batches a wave of ``step_length``-position steps can have (none when batching is off)."""
    max_wave = policy.max_wave_for(step_length) if policy.batching_enabled else 0
    return sorted({policy.wave_for(k) for k in range(max(2, policy.min_active_rows), max_wave + 1)})


def _samples_in(policy: PrefillPolicy, body: PrefillTraceSignature) -> bool:
    """Whether sampled rows can run in a wave of ``body``'s padded batch."""
    return policy.max_sampled_wave is None or body.padded_batch <= policy.max_sampled_wave


def _tiles(policy: PrefillPolicy, body: PrefillTraceSignature, shortest: int, longest: int) -> tuple[int | None, ...]:
    if not policy.static_last_token_tile or body.variant is not RequestKind.REGULAR_SINGLE:
        return (None,)
    return tuple(sorted({(n - 1) // policy.tile_size * policy.tile_size for n in range(shortest, longest + 1)}))


def _check_arguments(policy: object, layout: object) -> None:
    for name, value, kind in (("policy", policy, PrefillPolicy), ("layout", layout, PageTableLayout)):
        if not isinstance(value, kind):
            rule = f"must be a {kind.__name__}, got {type(value).__name__}"
            raise field_error(PrefillInputError, "manifest_for", name, value, rule)


def manifest_for(
    policy: PrefillPolicy,
    layout: PageTableLayout,
    sampling_paths: Iterable[SamplingPath] = ALL_PATHS,
    *,
    attention: AttentionLayout | None = None,
) -> WarmupManifest:
    """Every program and trace signature ``policy`` can produce on ``layout``.

    ``attention``: a hybrid model's KV groups; every signature then names
    its groups' widths (``group_tables.body_groups``), as ``prepare_grouped``'s do.
    """
    _check_arguments(policy, layout)
    check_policy_fits_layout(policy, layout)
    paths = tuple(sampling_paths) if not isinstance(sampling_paths, (str, bytes)) else (sampling_paths,)
    for path in paths:
        if not isinstance(path, SamplingPath):
            rule = "must be SamplingPath members (SamplingPath('logits'), not 'logits')"
            raise field_error(PrefillInputError, "manifest_for", "sampling_paths", path, rule)
    programs: list[PrefillProgramSignature] = []
    traces: list[PrefillTraceSignature] = []
    for body, shortest, longest in _bodies(policy, layout):
        if attention is not None:
            body = attrs.evolve(body, groups=body_groups(body, attention, policy, layout))
        if policy.is_trace_eligible(body.chunk_length):
            traces.append(body)
        for path in paths:
            if body.padded_batch > 1 and path is not SamplingPath.LOGITS and not _samples_in(policy, body):
                continue  # a sampled wave this wide is never planned (max_sampled_wave)
            device_samples = path in (SamplingPath.ARGMAX, SamplingPath.TOPK)
            for logprobs in (False, True) if device_samples and policy.max_logprobs else (False,):
                for tile in _tiles(policy, body, shortest, longest):
                    programs.append(
                        PrefillProgramSignature(
                            body.variant,
                            body.padded_batch,
                            body.chunk_length,
                            body.page_table_width,
                            body.read_table_width,
                            path,
                            logprobs,
                            tile,
                            groups=body.groups,
                        )
                    )
    return WarmupManifest(_sorted_unique(programs), _sorted_unique(traces))
