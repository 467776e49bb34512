"""Human-readable tables of plans and manifests (the ``python -m prefill_core`` CLI)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefill_core.calls.manifest import WarmupManifest
from prefill_core.inputs.batch import PrefillBatch, PrefillRow
from prefill_core.planning.prepared import PreparedPrefill
from prefill_core.values.errors import ArgumentError
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy

if TYPE_CHECKING:
    from prefill_core.tuning.tuner import TunedLadder

__all__ = [
    "parse_lengths",
    "parse_cached",
    "MAX_SAMPLE_BLOCKS",
    "check_sample_blocks",
    "sample_batches",
    "plan_table",
    "manifest_table",
    "tune_table",
]


def _positive(argument: str, text: str, what: str) -> int:
    if not text.strip().isdecimal() or int(text) <= 0:
        raise ArgumentError(f"{argument}: {text.strip()!r} is not {what} (a positive integer)")
    return int(text)


MAX_SAMPLE_BLOCKS = 1 << 20
"""Most block ids the CLI maps for its sample rows (32M tokens at 32-token blocks).

A sample row maps one block id per block, as a caller's page table does, so
a length or count far past any model's context would exhaust memory rather
than print a table.
"""


def check_sample_blocks(argument: str, num_blocks: int, block_size: int) -> None:
    """Raises ``ArgumentError`` when the sample rows of ``argument`` would map more than ``MAX_SAMPLE_BLOCKS``."""
    if num_blocks > MAX_SAMPLE_BLOCKS:
        msg = (
            f"{argument}: the rows need {num_blocks} blocks of {block_size} tokens; "
            f"the CLI maps at most {MAX_SAMPLE_BLOCKS} (use fewer or shorter rows, or a larger --block)"
        )
        raise ArgumentError(msg)


def parse_lengths(spec: str) -> list[tuple[int, int]]:
    """``"100,4097,15x128"`` -> ``[(1, 100), (1, 4097), (15, 128)]`` (count, length)."""
    groups = []
    for item in spec.split(","):
        count, sep, length = item.strip().rpartition("x")
        number = _positive("--lengths", count, "a row count") if sep else 1
        groups.append((number, _positive("--lengths", length, "a LENGTH or COUNTxLENGTH length")))
    return groups


def parse_cached(spec: str, num_groups: int) -> list[int]:
    """``"768,0"`` -> ``[768, 0]``: one cached length per length group (empty: none cached)."""
    if not spec:
        return [0] * num_groups
    values = []
    for item in spec.split(","):
        if not item.strip().isdecimal():
            raise ArgumentError(f"--cached: {item.strip()!r} is not a cached length (an integer >= 0)")
        values.append(int(item))
    if len(values) != num_groups:
        raise ArgumentError(f"--cached: {len(values)} values given for {num_groups} length groups")
    return values


def sample_batches(
    groups: list[tuple[int, int]], cached: list[int], layout: PageTableLayout, policy: PrefillPolicy
) -> list[tuple[int, PrefillBatch]]:
    """``(first row, batch)`` per sub-batch (at most ``lane_size`` rows) of the rows ``groups`` describe.

    Rows get disjoint blocks in order; each sub-batch uses slots ``0..k-1``,
    as a caller without explicit slots does.
    """
    shapes = [(length, cached[group]) for group, (count, length) in enumerate(groups) for _ in range(count)]
    rows, next_block = [], 0
    for length, offset in shapes:
        need = layout.blocks_for(length)
        rows.append((length, offset, tuple(range(next_block, next_block + need))))
        next_block += need
    out = []
    for sub_batch in policy.sub_batches(len(rows)):
        picked = [PrefillRow(rows[i][0], rows[i][1], slot, rows[i][2]) for slot, i in enumerate(sub_batch)]
        out.append((sub_batch.start, PrefillBatch.from_rows(picked)))
    return out


def _rows_text(rows: tuple[int, ...]) -> str:
    if len(rows) > 2 and rows == tuple(range(rows[0], rows[-1] + 1)):
        return f"{rows[0]}-{rows[-1]}"
    return ",".join(map(str, rows))


def plan_table(prepared: tuple[PreparedPrefill, ...], first_rows: tuple[int, ...] | None = None) -> str:
    """The plan as a table; ``first_rows[i]`` offsets request i's rows (sub-batches of one call)."""
    header = (
        "#",
        "kind",
        "rows",
        "active/padded",
        "padded len",
        "chunk",
        "chunks (first start)",
        "tables",
        "sampling",
        "efficiency",
    )
    lines = [header]
    real = computed = 0
    for i, p in enumerate(prepared):
        r = p.request
        tables = f"{r.fill_table.role.value}[{r.fill_table.width}]"
        if r.read_table is not None:
            tables += f" + {r.read_table.role.value}[{r.read_table.width}]"
        real, computed = real + r.real_tokens, computed + r.computed_tokens
        lines.append(
            (
                str(i),
                r.kind.value,
                _rows_text(tuple(row + (first_rows[i] if first_rows else 0) for row in r.source_rows)),
                f"{r.active_batch_size}/{r.padded_batch}",
                str(r.padded_length),
                str(r.chunk_length),
                f"{r.num_chunks} ({r.first_chunk_start})",
                tables,
                p.sampling_path.value,
                f"{r.real_tokens / r.computed_tokens:.1%}",
            )
        )
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
    out.append(
        f"{len(manifest.program_signatures)} program signatures, {len(manifest.trace_signatures)} trace signatures"
    )
    return "\n".join(out)


def _ladder_text(policy: PrefillPolicy) -> str:
    return ", ".join(map(str, policy.length_ladder)) + ", then powers of two"


def tune_table(result: TunedLadder) -> str:
    """The tuned ladder next to the default: traces, positions per real token, max chunk and rungs."""
    rows = [("ladder", "traces", "positions / real token", "max chunk", "rungs")]
    for name, policy, cost in (
        ("default", result.default, result.default_cost),
        ("tuned", result.policy, result.cost),
    ):
        per_token = f"{cost.positions}/{cost.real_tokens} = {cost.per_real_token:.3f}"
        rows.append((name, str(cost.traces), per_token, str(policy.max_chunk_length), _ladder_text(policy)))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
