"""Device work a plan asks for, counted (not timed): positions computed and page-table entries staged.

Per workload (block 32, default policy unless stated):

* computed / real: positions every step computes, all rows of the padded
  wave included, over real tokens (``max(length - cached, 1)`` per row: a
  fully cached row still owes one);
* the same without padding rows (active rows only);
* page-table entries staged per step (fill table plus read table);
* tt-metal's rule: ``rung(length - cached)`` per chunked or cached row and
  ``rung(length)`` per regular row, over the same real tokens.

Counts do not drift with the machine, so they are the targets: the chat
workload must not compute more than tt-metal's rule. The JSON goes to
benchmarks/results/plan_cost.json.

Under tt-transformers' Galaxy brief (``PrefillPolicy.from_tt_transformers``:
32-row waves, >= 16 active rows, waves up to 2048 positions), per workload
and for a cached-chat workload (32 turns of 20-120 new tokens behind one
cached 512-token system prompt): positions per real token and model-body
steps of our padded plan, of it with cached rows batched
(``batch_cached_rows``), of our packed plan, and of tt-transformers' rule
(``tests/tt_transformers_rule.py``, written from its documented semantics).
Targets: ours at most tt-transformers' plus one final-block re-run per
fully cached row; batched cached chat in fewer steps than its singles and
at most 2x its positions.

Positions are also counted where they are computed: every workload runs
through the runtime on an instrumented reference Llama (``CountingLlama``:
the tiny preset, one layer, attention's arithmetic skipped) that counts the
positions its body's MLP computes, padding rows apart, once on the torch
backend's default plan (packed steps on the CPU) and once on the padded
plan of the ttnn default policy (tt-metal's ladder).

A windowed model (``windowed_*``: one sliding group with a 1,024 window and
one full group, a 32,768-token prompt, default policy) is counted from its
staged per-group read tables (``prepare_grouped``): the most key positions
one step of a sliding layer gathers (mapped read columns x block size, at
most ``chunk + window - 1`` rounded out to whole blocks) beside a full
layer's, and the keys every query of the prompt reads in all
(``windows.positions_read``), sliding over full.

    python benchmarks/plan_cost.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs

from benchmarks._counting_llama import body_positions
from benchmarks._report import Metric, report
from prefill_core import (
    AttentionLayout,
    PageTableLayout,
    PrefillBatch,
    PrefillPolicy,
    PrefillRow,
    ceil_div,
    plan_packed,
    plan_prefill,
    prepare_grouped,
)
from prefill_core.kv_groups.windows import positions_read
from tests.tt_transformers_rule import GALAXY, tt_transformers_cost

BLOCK = 32
POLICY = PrefillPolicy()
GALAXY_POLICY = PrefillPolicy.from_tt_transformers(
    physical_batch_sizes=GALAXY.physical_batch_sizes,
    minimum_active_rows=GALAXY.minimum_active_rows,
    maximum_sequence_length=GALAXY.maximum_sequence_length,
)


def layout_for(longest: int) -> PageTableLayout:
    return PageTableLayout(BLOCK, ceil_div(longest, BLOCK), 1 << 22)


def batch_of(shapes: list[tuple[int, int]]) -> PrefillBatch:
    """Rows of ``(length, cached)`` with disjoint consecutive blocks and slots 0..n-1."""
    rows, block = [], 0
    for slot, (length, cached) in enumerate(shapes):
        need = ceil_div(length, BLOCK)
        rows.append(PrefillRow(length, cached, slot, tuple(range(block, block + need))))
        block += need
    return PrefillBatch.from_rows(rows)


def workloads() -> dict[str, list[list[tuple[int, int]]]]:
    """Each workload as its batches of ``(length, cached)`` rows (seeded: the counts are fixed)."""
    rng = random.Random(20240611)
    chat = []
    for _ in range(2):
        rows = []
        for _ in range(32):
            length = rng.randint(1000, 20000)
            fresh = rng.randint(20, 500)  # the new turn: all but these tokens are cached, block aligned
            rows.append((length, (length - fresh) // BLOCK * BLOCK))
        chat.append(rows)
    return {
        "32x128": [[(128, 0)] * 32],
        "32_mixed_20_1000": [[(rng.randint(20, 1000), 0) for _ in range(32)]],
        "chat_prefix_cached_64": chat,
        "one_131072_cached_2048": [[(131072, 2048)]],
        "16_fully_cached_2048": [[(2048, 2048)] * 16],
    }


def tt_metal_positions(length: int, cached: int) -> int:
    """tt-metal's rule for one row: the rung of its uncached work (its regular rung when uncached)."""
    return POLICY.padded_length(max(length - cached, 1))


def counts(batches: list[list[tuple[int, int]]]) -> dict[str, float]:
    real = computed = active = entries = num_steps = reference = 0
    for shapes in batches:
        layout = layout_for(max(length for length, _ in shapes))
        for request in plan_prefill(batch_of(shapes), POLICY, layout):
            real += request.real_tokens
            computed += request.computed_tokens
            active += request.active_batch_size * request.num_chunks * request.chunk_length
            read = 0 if request.read_table is None else request.read_table.width
            entries += request.num_chunks * request.padded_batch * (request.fill_table.width + read)
            num_steps += request.num_chunks
        reference += sum(tt_metal_positions(length, cached) for length, cached in shapes)
    return {
        "computed_per_real": computed / real,
        "active_per_real": active / real,
        "table_entries_per_step": entries / num_steps,
        "steps": num_steps,
        "tt_metal_per_real": reference / real,
    }


def windowed_metrics(length: int = 32768, window: int = 1024) -> list[Metric]:
    """Positions a windowed model's steps read per layer kind, from the planned per-group read tables."""
    attention = AttentionLayout.from_layer_types(
        ["sliding_attention", "full_attention"], sliding_window=window, block_size=BLOCK
    )
    need = ceil_div(length, BLOCK)
    tables = (tuple(range(1, need + 1)),), (tuple(range(need + 1, 2 * need + 1)),)
    batch = PrefillBatch((length,), (0,), (0,), tables[0][0:1], (None,))
    planned = prepare_grouped(batch, POLICY, layout_for(length), attention, tables, null_block=0)
    most = [0, 0]
    for grouped in planned:
        request = grouped.request
        for index in range(request.num_chunks):
            for g, step in enumerate(grouped.step_tables(index)):
                mapped = sum(1 for block in step.read[0] if block > 0) if step.read else 0
                most[g] = max(most[g], mapped * BLOCK)
    chunk = planned[0].request.chunk_length
    name = f"windowed_{length}_w{window}"
    sliding_keys, full_keys = positions_read(0, length, window), positions_read(0, length, None)
    return [
        Metric(
            f"{name}_sliding_positions_read_per_step",
            most[0],
            "count",
            ceil_div(chunk + window - 1, BLOCK) * BLOCK + BLOCK,
            f"chunk {chunk}; bound: chunk + window - 1 = {chunk + window - 1}, in whole blocks",
        ),
        Metric(f"{name}_full_positions_read_per_step", most[1], "count", None, "the full group: the prompt so far"),
        Metric(f"{name}_sliding_over_full_keys_read", sliding_keys / full_keys, "ratio", None, "sum over queries"),
    ]


def cached_chat() -> list[list[tuple[int, int]]]:
    """32 turns of 20-120 new tokens behind one cached 512-token system prompt (seeded)."""
    rng = random.Random(35)
    return [[(512 + rng.randint(20, 120), 512) for _ in range(32)]]


def galaxy_counts(batches: list[list[tuple[int, int]]]) -> dict[str, float]:
    """Positions per real token and steps: ours (padded, cached rows batched, packed) and tt-transformers' rule."""
    cached_waves = attrs.evolve(GALAXY_POLICY, batch_cached_rows=True, isolate_cached_buckets=False)
    totals = dict.fromkeys(("real", "ours", "ours_steps", "cached", "cached_steps", "packed", "packed_steps"), 0)
    totals |= dict(tt=0, tt_steps=0, allowance=0)
    for shapes in batches:
        batch, layout = batch_of(shapes), layout_for(max(n for n, _ in shapes))
        totals["real"] += sum(max(n - c, 1) for n, c in shapes)
        for key, policy in (("ours", GALAXY_POLICY), ("cached", cached_waves)):
            plan = plan_prefill(batch, policy, layout)
            totals[key] += sum(r.computed_tokens for r in plan)
            totals[key + "_steps"] += sum(r.num_chunks for r in plan)
        packed = plan_packed(batch, GALAXY_POLICY, layout)
        totals["packed"] += sum(r.computed_tokens for r in packed)
        totals["packed_steps"] += sum(r.num_chunks for r in packed)
        positions, steps = tt_transformers_cost([n for n, _ in shapes], [c for _, c in shapes], GALAXY)
        totals["tt"], totals["tt_steps"] = totals["tt"] + positions, totals["tt_steps"] + steps
        totals["allowance"] += sum(n == c for n, c in shapes) * GALAXY_POLICY.fully_cached_step(BLOCK)
    real = totals.pop("real")
    return {key: value if key.endswith("steps") else value / real for key, value in totals.items()}


def galaxy_metrics() -> list[Metric]:
    metrics = []
    for name, batches in {**workloads(), "cached_chat_32x512": cached_chat()}.items():
        g = galaxy_counts(batches)
        bound = g["tt"] + g["allowance"]
        metrics += [
            Metric(f"galaxy_{name}_ours_per_real", g["ours"], "ratio", bound, f"{g['ours_steps']} steps"),
            Metric(f"galaxy_{name}_tt_transformers_per_real", g["tt"], "ratio", None, f"{g['tt_steps']} steps"),
            Metric(f"galaxy_{name}_packed_per_real", g["packed"], "ratio", None, f"{g['packed_steps']} steps"),
        ]
        if name.startswith("cached_chat"):
            note = f"{g['cached_steps']} steps (target: fewer than {g['tt_steps']})"
            metrics.append(Metric(f"galaxy_{name}_cached_waves_per_real", g["cached"], "ratio", 2 * g["tt"], note))
            metrics.append(Metric(f"galaxy_{name}_cached_waves_steps", g["cached_steps"], "count", g["tt_steps"] - 1))
    return metrics


def main() -> int:
    metrics = galaxy_metrics()
    metrics += windowed_metrics()
    for name, batches in workloads().items():
        c = counts(batches)
        real = sum(max(n - k, 1) for shapes in batches for n, k in shapes)
        for label, padded in (("torch_default", False), ("ttnn_default_padded", True)):
            body = body_positions(batches, BLOCK, padded)
            rule = f"{'padded, PrefillPolicy()' if padded else 'TorchBackend().preferred_policy'}; counted in the body"
            metrics.append(Metric(f"{name}_body_{label}_per_real", body / real, "ratio", None, rule))
        # Only the chat workload carries a target: tt-metal's rule, which the plan must not exceed.
        target = c["tt_metal_per_real"] if name.startswith("chat") else None
        metrics += [
            Metric(f"{name}_computed_per_real", c["computed_per_real"], "ratio", None, "padding rows included"),
            Metric(f"{name}_active_per_real", c["active_per_real"], "ratio", target, "padding rows excluded"),
            Metric(
                f"{name}_tt_metal_rule_per_real",
                c["tt_metal_per_real"],
                "ratio",
                None,
                "rung(max(length - cached, 1)) per row",
            ),
            Metric(f"{name}_table_entries_per_step", c["table_entries_per_step"], "count", None, f"{c['steps']} steps"),
        ]
    report("plan_cost", metrics)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
