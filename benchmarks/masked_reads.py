"""What safe pool reads cost: the old full-width masked read vs the eager and fixed-shape reads.

A chunked step's attention used to gather the whole read table (filler and
the row's later blocks included) and rely on a boolean mask, which let NaN
there poison the output (issue 15 item 9). The reference model now reads the
prefix before the chunk plus the chunk's own fresh K/V: eagerly only the
prefix columns, in its fixed-shape (capture-safe) form ``Wr - S/bs`` columns
with unreadable positions zeroed by selection.

Cases, each the last step the runtime's own planner makes (block size 32,
default policy, the ``demo`` preset cut to 2 layers: 4 query and 2 KV heads of 64):

* ``chunk2_of_2049``: the second 2048-token chunk of an uncached 2049-token row;
* ``cached_3000_at_2048``: a 3000-token row with 2048 cached (one 1024 chunk);
* ``cached_33_at_32``: a 33-token row with 32 cached (one 128-token chunk).

``attention`` times the part that changed: one step's mask and, for every
layer, the pool read plus SDPA, on the same fresh Q/K/V. ``step`` times a
whole ``forward_hidden`` (eager vs fixed shape; the old read no longer
exists in the model). Variants alternate and their order rotates every
repeat (the step, a third as many times); medians in microseconds and
ratios to the old read. One torch thread.

    python benchmarks/masked_reads.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Metric, report
from prefill_core import PageTableLayout, PrefillBatch, PrefillPolicy, PrefillRow, ceil_div, plan_prefill
from prefill_shell.reference import random_llama
from prefill_shell.reference.llama_like.llama import _chunk_reads, _with_prefix

BLOCK = 32
NUM_BLOCKS = 160
CASES = (("chunk2_of_2049", 2049, 0), ("cached_3000_at_2048", 3000, 2048), ("cached_33_at_32", 33, 32))
VARIANTS = ("old", "eager", "fixed")


def last_step(model, length: int, cached: int) -> dict:
    """Inputs of the planner's last step for one row on blocks 1.., with fresh Q/K/V for the attention timing."""
    blocks = tuple(range(1, 1 + ceil_div(length, BLOCK)))
    layout = PageTableLayout(BLOCK, model.spec.max_position // BLOCK, NUM_BLOCKS)
    batch = PrefillBatch.from_rows((PrefillRow(length, cached, 0, blocks),))
    (request,) = plan_prefill(batch, PrefillPolicy(), layout)
    chunk, width = request.chunk_length, request.read_table.width
    start = request.first_chunk_start + (request.num_chunks - 1) * chunk
    read = torch.tensor([list(blocks) + [0] * (width - len(blocks))], dtype=torch.int32)
    columns = range(start, start + chunk, BLOCK)
    fill = torch.tensor([[blocks[p // BLOCK] if cached <= p < length else -1 for p in columns]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(length)
    spec = model.spec

    def normal(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, chunk, spec.head_dim, generator=gen)

    tokens = torch.randint(1, spec.vocab_size, (1, chunk), generator=gen)
    return {
        "start": torch.tensor([start]),
        "real": length - start,
        "read": read,
        "fill": fill,
        "tokens": tokens,
        "q": normal(spec.num_heads),
        "k": normal(spec.num_kv_heads),
        "v": normal(spec.num_kv_heads),
    }


def old_attention(kv, case: dict) -> list[torch.Tensor]:
    """The read before the fix: every table column, a causal mask over absolute key positions."""
    q, read, bs = case["q"], case["read"], kv.block_size
    positions = case["start"][:, None] + torch.arange(q.shape[2])
    key_pos = torch.arange(read.shape[1] * bs)
    mask = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)
    outs = []
    for layer in range(kv.num_layers):
        k_all, v_all = kv.gather(layer, read)
        outs.append(F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True))
    return outs


def new_attention(kv, case: dict, fixed_shape: bool) -> list[torch.Tensor]:
    """The model's read now (eager or fixed shape), as ``PagedLlama._attention`` runs it."""
    q, k, v, read = case["q"], case["k"], case["v"], case["read"]
    reads = _chunk_reads(case["start"], q.shape[2], read, kv.block_size, fixed_shape)
    outs = []
    for layer in range(kv.num_layers):
        if reads.mask is None:
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            continue
        k_all, v_all = _with_prefix(kv, layer, k, v, read, reads)
        outs.append(F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=reads.mask, enable_gqa=True))
    return outs


def prepared_pool(model, case: dict):
    """A pool whose chunk blocks already hold the step's fresh K/V, so the old and new reads see the same keys."""
    kv = model.new_kv_cache(NUM_BLOCKS, BLOCK)
    gen = torch.Generator().manual_seed(7)
    for pool in kv.keys + kv.values:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    for layer in range(kv.num_layers):
        kv.fill(layer, case["k"], case["v"], case["fill"])
    return kv


def timed_rounds(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median microseconds per variant; variants alternate and the order rotates every repeat."""
    names = list(calls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for name in names:
        calls[name]()  # warm-up
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            begin = time.perf_counter()
            calls[name]()
            samples[name].append((time.perf_counter() - begin) * 1e6)
    return {n: statistics.median(s) for n, s in samples.items()}


def case_metrics(model, name: str, case: dict, repeats: int) -> list[Metric]:
    kv = prepared_pool(model, case)
    old = old_attention(kv, case)
    # Only real queries are comparable: the old read let padding queries see filler keys.
    real = case["real"]
    for fixed_shape in (False, True):
        new = new_attention(kv, case, fixed_shape)
        diff = max((a - b)[:, :, :real].abs().max().item() for a, b in zip(old, new))
        assert diff < 1e-4, f"{name}: new read (fixed_shape={fixed_shape}) differs from the old by {diff:.3g}"
    attention = timed_rounds(
        {
            "old": lambda: old_attention(kv, case),
            "eager": lambda: new_attention(kv, case, False),
            "fixed": lambda: new_attention(kv, case, True),
        },
        repeats,
    )
    step_args = (case["tokens"], case["start"], case["fill"], case["read"], kv)
    step = timed_rounds(
        {
            "eager": lambda: model.forward_hidden(*step_args, fixed_shape=False),
            "fixed": lambda: model.forward_hidden(*step_args, fixed_shape=True),
        },
        max(repeats // 3, 3),
    )
    chunk, width, start = case["q"].shape[2], case["read"].shape[1] * BLOCK, int(case["start"])
    keys = {"old": f"{width} keys", "eager": f"{start + chunk} keys", "fixed": f"{max(width - chunk, 0) + chunk} keys"}
    out = [Metric(f"{name}.attention.{v}", attention[v], "us", note=keys[v]) for v in VARIANTS]
    out += [Metric(f"{name}.attention.{v}_vs_old", attention[v] / attention["old"], "x") for v in VARIANTS[1:]]
    out += [Metric(f"{name}.step.{v}", step[v], "us") for v in ("eager", "fixed")]
    out.append(Metric(f"{name}.step.fixed_vs_eager", step["fixed"] / step["eager"], "x"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats: well under a minute")
    parser.add_argument("--repeats", type=int, default=None, help="attention measurements per variant and case")
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 11)
    torch.set_num_threads(1)
    model = random_llama(0, "demo", num_layers=2)
    metrics = []
    with torch.inference_mode():
        for name, length, cached in CASES:
            metrics += case_metrics(model, name, last_step(model, length, cached), repeats)
    report("masked_reads", metrics)


if __name__ == "__main__":
    main()
