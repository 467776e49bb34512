"""``python -m prefill_core plan|manifest|tune``: explain a plan or a warm-up bill, or tune a ladder."""

from __future__ import annotations

import argparse
import sys

import attrs

from prefill_core.calls.manifest import manifest_for
from prefill_core.calls.warmup import ModelGeometry, limited_to, warmup_cost
from prefill_core.cli.explain import (
    check_sample_blocks,
    manifest_table,
    parse_cached,
    parse_lengths,
    plan_table,
    sample_batches,
    tune_table,
)
from prefill_core.inputs.options import argparse_type, block_size_option, count_option
from prefill_core.planning.prepared import prepare_prefill
from prefill_core.tuning.histogram import parse_histogram
from prefill_core.tuning.tuner import tune
from prefill_core.values.errors import ArgumentError, PrefillInputError
from prefill_core.values.intmath import ceil_div
from prefill_core.values.layout import PageTableLayout
from prefill_core.values.policy import PrefillPolicy
from prefill_core.values.serialize import to_json

COUNT, BLOCK_SIZE = argparse_type(count_option), argparse_type(block_size_option)


def _non_negative_int(text: str) -> int:
    if not text.strip().isdecimal():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return int(text)


def _policy(args: argparse.Namespace) -> PrefillPolicy:
    return PrefillPolicy(max_chunk_length=args.max_chunk, batching_enabled=not args.no_batching)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block", type=BLOCK_SIZE, default=32, help="KV block size (tokens, a power of two)")
    parser.add_argument("--max-chunk", type=COUNT, default=2048, help="max chunk length (tokens)")
    parser.add_argument("--no-batching", action="store_true", help="plan every row as a single request")
    parser.add_argument("--json", action="store_true", help="print the cattrs JSON instead of a table")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefill_core")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan a sample batch and print it")
    plan.add_argument("--lengths", default="100,4097,15x128", help="comma list of LENGTH or COUNTxLENGTH")
    plan.add_argument("--cached", default="", help="cached prefix per length group (comma list)")
    _add_common(plan)
    manifest = sub.add_parser("manifest", help="enumerate every signature a policy can produce")
    manifest.add_argument("--max-length", type=COUNT, default=8192, help="longest prompt the layout maps")
    manifest.add_argument("--max-batch", type=COUNT, default=32, help="most rows one call batches (max_batch_size)")
    manifest.add_argument("--hidden-size", type=COUNT, default=576, help="model hidden size (default: SmolLM2's)")
    manifest.add_argument("--vocab-size", type=COUNT, default=49152, help="model vocabulary (default: SmolLM2's)")
    manifest.add_argument("--dtype-bytes", type=COUNT, default=4, help="bytes per hidden element (4: float32)")
    manifest.add_argument("--lengths", default=None, help="warm only these invocation lengths (comma list)")
    manifest.add_argument("--fine-rungs", action="store_true", help="the CPU's policy (PrefillPolicy.fine_rungs)")
    _add_common(manifest)
    tuner = sub.add_parser("tune", help="pick ladder rungs and a max chunk for a length histogram")
    tuner.add_argument("--lengths", required=True, help="histogram file: LENGTH [COUNT [CACHED]] per line")
    tuner.add_argument(
        "--cached", type=_non_negative_int, default=0, help="shared cached prefix (tokens) where a line has none"
    )
    tuner.add_argument("--max-traces", type=int, required=True, help="trace budget (distinct trace signatures)")
    tuner.add_argument("--block", type=BLOCK_SIZE, default=32, help="KV block size (tokens, a power of two)")
    tuner.add_argument(
        "--max-chunk", type=COUNT, default=2048, help="largest max chunk to pick; the default's (tokens)"
    )
    tuner.add_argument("--json", action="store_true", help="print the tuned PrefillPolicy as cattrs JSON")
    tuner.set_defaults(no_batching=False)
    args = parser.parse_args(argv)
    try:
        policy = _policy(args)
        if args.command == "plan":
            _plan(args, policy)
        elif args.command == "tune":
            _tune(args, policy)
        else:
            _manifest(args, policy)
    except (ArgumentError, PrefillInputError, OSError, UnicodeDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _manifest(args: argparse.Namespace, policy: PrefillPolicy) -> None:
    """The manifest's table, then what warming it costs: with a backend that builds programs per shape (a
    device) and with one that does not (the CPU), before anything runs."""
    layout = PageTableLayout(args.block, ceil_div(args.max_length, args.block), 1)
    if args.fine_rungs:
        fine = PrefillPolicy.fine_rungs(args.block, max_chunk_length=args.max_chunk)
        policy = attrs.evolve(fine, batching_enabled=policy.batching_enabled)
    policy = attrs.evolve(policy, max_batch_size=min(policy.max_batch_size, args.max_batch))
    bill = manifest_for(policy, layout)
    if args.lengths is not None:
        bill = limited_to(bill, [length for _, length in parse_lengths(args.lengths)])
    if args.json:
        print(bill.to_json())
        return
    model = ModelGeometry(args.hidden_size, args.vocab_size, args.dtype_bytes, policy.max_logprobs)
    print(manifest_table(bill))
    for backend, compiles in (("device (compiles per shape)", True), ("cpu (compiles nothing)", False)):
        print(f"warm-up on a {backend}: {warmup_cost(bill, model, compiles_programs=compiles)}")


def _plan(args: argparse.Namespace, policy: PrefillPolicy) -> None:
    """Plans the sample rows, sub-batch by sub-batch, and prints one table."""
    groups = parse_lengths(args.lengths)
    cached = parse_cached(args.cached, len(groups))
    longest = max(length for _, length in groups)
    total = sum(count * ceil_div(length, args.block) for count, length in groups)
    check_sample_blocks("--lengths", total, args.block)
    layout = PageTableLayout(args.block, ceil_div(longest, args.block), max(total, 1))
    prepared, first_rows = [], []
    for first_row, batch in sample_batches(groups, cached, layout, policy):
        for item in prepare_prefill(batch, policy, layout):
            prepared.append(item)
            first_rows.append(first_row)
    print(to_json(tuple(prepared), indent=1) if args.json else plan_table(tuple(prepared), tuple(first_rows)))


def _tune(args: argparse.Namespace, policy: PrefillPolicy) -> None:
    """Tunes a ladder for the histogram file; ``policy`` (tt-metal's ladder) is the comparison."""
    with open(args.lengths, encoding="utf-8-sig") as file:  # a byte-order mark (Windows editors) is not text
        entries = parse_histogram(file.read(), block_size=args.block, cached=args.cached)
    # The tuner plans each entry once, as one sample row (its count only weighs it).
    check_sample_blocks("--lengths", sum(ceil_div(entry.length, args.block) for entry in entries), args.block)
    result = tune(entries, block_size=args.block, max_traces=args.max_traces, default=policy)
    print(to_json(result.policy, indent=1) if args.json else tune_table(result))


if __name__ == "__main__":
    sys.exit(main())
