"""Human-readable tables of plans and manifests (the ``python -m prefill_core`` CLI)."""

from __future__ import annotations

from .batch import PrefillBatch, PrefillRow
from .layout import PageTableLayout
from .manifest import WarmupManifest
from .prepared import PreparedPrefill

__all__ = ["parse_lengths", "sample_batch", "plan_table", "manifest_table"]


def parse_lengths(spec: str) -> list[tuple[int, int]]:
    """``"100,4097,15x128"`` -> ``[(1, 100), (1, 4097), (15, 128)]`` (count, length)."""
    groups = []
    for item in spec.split(","):
        count, _, length = item.strip().rpartition("x")
        groups.append((int(count) if count else 1, int(length)))
    return groups


def sample_batch(groups: list[tuple[int, int]], cached: list[int], layout: PageTableLayout) -> PrefillBatch:
    """A batch with one group of rows per ``(count, length)``, given disjoint blocks in order."""
    if cached and len(cached) != len(groups):
        raise SystemExit(f"--cached has {len(cached)} values for {len(groups)} length groups")
    rows, next_block = [], 0
    for group, (count, length) in enumerate(groups):
        for _ in range(count):
            need = layout.blocks_for(length)
            blocks = tuple(range(next_block, next_block + need))
            next_block += need
            rows.append(PrefillRow(length, cached[group] if cached else 0, len(rows), blocks))
    return PrefillBatch.from_rows(tuple(rows))


def _rows_text(rows: tuple[int, ...]) -> str:
    if len(rows) > 2 and rows == tuple(range(rows[0], rows[-1] + 1)):
        return f"{rows[0]}-{rows[-1]}"
    return ",".join(map(str, rows))


def plan_table(prepared: tuple[PreparedPrefill, ...]) -> str:
    header = ("#", "kind", "rows", "active/padded", "padded len", "chunk", "chunks (first start)", "tables", "sampling", "efficiency")
    lines = [header]
    real = computed = 0
    for i, p in enumerate(prepared):
        r = p.request
        tables = f"{r.fill_table.role.value}[{r.fill_table.width}]"
        if r.read_table is not None:
            tables += f" + {r.read_table.role.value}[{r.read_table.width}]"
        real, computed = real + r.real_tokens, computed + r.computed_tokens
        lines.append((
            str(i), r.kind.value, _rows_text(r.source_rows), f"{r.active_batch_size}/{r.padded_batch}",
            str(r.padded_length), str(r.chunk_length), f"{r.num_chunks} ({r.first_chunk_start})", tables,
            p.sampling_path.value, f"{r.real_tokens / r.computed_tokens:.1%}",
        ))
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.append(f"padding efficiency (real / computed tokens): {real}/{computed} = {real / computed:.1%}")
    return "\n".join(out)


def manifest_table(manifest: WarmupManifest) -> str:
    out = [f"{'key':<24} {'variant':<16} {'batch':>5} {'length':>6} {'widths':>9}  sampling  logprobs"]
    for s in manifest.program_signatures:
        widths = f"{s.page_table_width}/{s.read_table_width}"
        out.append(
            f"{s.key:<24} {s.variant.value:<16} {s.padded_batch:>5} {s.invocation_length:>6} {widths:>9}  "
            f"{s.sampling_path.value:<8}  {s.logprobs}"
        )
    out.append(f"{len(manifest.program_signatures)} program signatures, {len(manifest.trace_signatures)} trace signatures")
    return "\n".join(out)
