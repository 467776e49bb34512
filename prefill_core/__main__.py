"""``python -m prefill_core plan|manifest``: explain a plan or a warm-up bill."""

from __future__ import annotations

import argparse
import sys

from .errors import PrefillInputError
from .explain import manifest_table, parse_lengths, plan_table, sample_batch
from .layout import PageTableLayout
from .manifest import manifest_for
from .policy import PrefillPolicy
from .prepared import prepare_prefill
from .serialize import to_json


def _policy(args: argparse.Namespace) -> PrefillPolicy:
    return PrefillPolicy(max_chunk_length=args.max_chunk, batching_enabled=not args.no_batching)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block", type=int, default=32, help="KV block size (tokens)")
    parser.add_argument("--max-chunk", type=int, default=2048, help="max chunk length (tokens)")
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
    manifest.add_argument("--max-length", type=int, default=8192, help="longest prompt the layout maps")
    _add_common(manifest)
    args = parser.parse_args(argv)
    try:
        policy = _policy(args)
        if args.command == "plan":
            groups = parse_lengths(args.lengths)
            cached = [int(c) for c in args.cached.split(",")] if args.cached else []
            longest = max(length for _, length in groups)
            total = sum(count * -(-length // args.block) for count, length in groups)
            layout = PageTableLayout(args.block, -(-longest // args.block), max(total, 1))
            prepared = prepare_prefill(sample_batch(groups, cached, layout), policy, layout)
            print(to_json(prepared, indent=1) if args.json else plan_table(prepared))
        else:
            layout = PageTableLayout(args.block, -(-args.max_length // args.block), 1)
            bill = manifest_for(policy, layout)
            print(bill.to_json() if args.json else manifest_table(bill))
    except PrefillInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
