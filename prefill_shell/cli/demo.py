"""The demo (``make demo``): one mixed batch of real prompts through the runtime, eager and traced.

The batch shows what the runtime is for:

* chat requests sharing one system prompt: its block-aligned part is
  prefilled once, and the requests then run with it cached, each writing
  its own partial last block;
* a document longer than the 2048-token max chunk, run in chunks;
* short questions, batched into one padded wave.

It prints the plan, each row's five most likely next tokens and a sampled
one, computed vs cached tokens, whether traced results equal eager ones,
and tokens per second. ``--model random:demo`` runs the same shapes on a
seeded random model with token ids in place of text.
"""

from __future__ import annotations

import argparse
import random
import time

from prefill_core import WarmupManifest
from prefill_core.cli.explain import plan_table
from prefill_shell.cli.main import make_runtime, print_rows, row_sampling, show_progress, stage
from prefill_shell.cli.model_dtype import load_cli_model
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference.loading.text import Prompt, encode, load_tokenizer
from prefill_shell.scoring.prefix_sharing import SharedPrefixBatch, share_prefix

__all__ = ["run_demo", "demo_prompts"]

SYSTEM = (
    "You are the help desk of the Northwind Rail Museum. Answer in one short sentence. Facts: "
    "The museum opens at 9 am and closes at 5 pm, Tuesday to Sunday; it is closed on Mondays. "
    "Tickets cost 12 euros for adults, 6 euros for children under 14, and nothing for children under 4. "
    "The oldest engine on display is the Blue Comet, a steam locomotive built in 1882. "
    "The cafe on the first floor serves soup, sandwiches and apple cake until 4 pm. "
    "Guided tours start every hour from the main hall and last forty minutes. "
    "Visitors may take photographs, but not with a flash. Dogs on a leash are welcome in the garden only. "
    "The nearest station is Harbour Street, five minutes away on foot."
)
QUESTIONS = (
    "What time does the museum open?",
    "How much is a ticket for my 10-year-old son?",
    "Can I bring my dog inside?",
    "Which is the oldest engine?",
    "Is there somewhere to eat?",
    "Are you open on Monday?",
)
SHORT = (
    "The capital of France is",
    "The largest planet in the solar system is",
    "Water is made of hydrogen and",
    "The opposite of hot is",
)
CITIES = ("Oslo", "Lisbon", "Cairo", "Lima", "Perth", "Quebec", "Nairobi", "Osaka")
SKIES = ("sunny", "rainy", "windy", "cloudy")


def document(lines: int = 130, seed: int = 0) -> str:
    """A long, regular text (a weather log) that ends mid-entry, so the next token is predictable."""
    rng = random.Random(seed)
    entries = []
    for day in range(1, lines + 1):
        city, degrees, sky = rng.choice(CITIES), rng.randint(-5, 35), rng.choice(SKIES)
        entries.append(f"Day {day}: in {city} it was {degrees} degrees and {sky}.")
    return "Weather log of the travelling reporter.\n" + "\n".join(entries) + f"\nDay {lines + 1}: in"


def demo_prompts(tokenizer, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[str], list[int]]:
    """(token ids, labels, rows sharing the system prompt) of the demo batch.

    Without a tokenizer (random models) the same structure is built from seeded ids.
    """
    labels = [f"chat {i}" for i in range(len(QUESTIONS))] + ["document"] + [f"short {i}" for i in range(len(SHORT))]
    members = list(range(len(QUESTIONS)))
    if tokenizer is None:
        rng = random.Random(seed)
        ids = lambda n: [rng.randrange(1, vocab_size) for _ in range(n)]  # noqa: E731
        system = ids(150)
        return (
            [system + ids(12 + i) for i in members] + [ids(2300)] + [ids(6 + i) for i in range(len(SHORT))],
            labels,
            members,
        )
    chats = [
        Prompt(messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": q})) for q in QUESTIONS
    ]
    prompts = chats + [Prompt(text=document())] + [Prompt(text=s) for s in SHORT]
    return [encode(tokenizer, p, chat=False) for p in prompts], labels, members


def _summary(batch: SharedPrefixBatch, prepared, members: list[int]) -> None:
    shared = len(batch.prefix_tokens)
    real = sum(p.request.real_tokens for p in prepared)
    computed = sum(p.request.computed_tokens for p in prepared)
    print(
        f"\nshared system prompt: {shared} tokens ({len(batch.prefix_blocks)} blocks) prefilled once, "
        f"then read from cache by {len(members)} rows"
    )
    print(
        f"batch: {sum(batch.lengths)} prompt tokens = {sum(batch.cached)} taken from cache + {real} computed "
        f"({computed} positions with padding); without the shared prefix the chat rows alone would compute "
        f"{sum(batch.lengths[i] for i in members)}"
    )


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def run_demo(args: argparse.Namespace) -> None:
    """Runs the demo batch on ``args.model`` (default: SmolLM2) and prints what it did."""
    with stage("load model and tokenizer"):
        (model, dtype), tokenizer = load_cli_model(args), load_tokenizer(args.model)
    ids, labels, members = demo_prompts(tokenizer, model.spec.vocab_size, args.seed)
    batch = share_prefix(ids, args.block_size, members)
    runtime = make_runtime(model, batch, args.block_size, args.device)
    executor = PrefillExecutor(runtime)
    sampling = row_sampling(len(ids), args.seed)
    call = (batch.tokens, batch.page_table, batch.lengths, batch.cached)
    with stage(f"prefill the shared prefix ({len(batch.prefix_tokens)} tokens)"):
        executor.prefill(*batch.prefix_call(), mode="eager", on_progress=show_progress)
    # Eager calls run packed steps where the runtime can (real tokens only); traces replay the padded plan.
    padded = runtime.prepare(*call, sampling=sampling, mode="traced")
    prepared = padded.requests
    packed_steps = sum(p.request.num_chunks for p in runtime.prepare(*call, sampling=sampling, mode="eager").requests)
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)'}, dtype {dtype.describe()}\n")
    print(plan_table(prepared), "\n")
    print(f"eager: {packed_steps} packed steps of real tokens only; traced: the padded plan above\n")
    with stage(f"eager prefill ({sum(batch.lengths) - sum(batch.cached)} uncached tokens)"):
        eager, eager_s = _timed(
            lambda: executor.prefill(*call, sampling=sampling, mode="eager", on_progress=show_progress)
        )
    with stage("warm-up on the observed programs (compile + capture)"):
        executor.warm_up(WarmupManifest().observe(prepared), on_progress=show_progress)
    with stage("traced prefill"):
        traced, traced_s = _timed(lambda: executor.prefill(*call, sampling=sampling, mode="traced"))
    print_rows(eager, batch, tokenizer, labels)
    _summary(batch, prepared, members)
    same = runtime.assemble(runtime.invocations(padded, mode="eager"), padded.num_rows) == traced
    drift = max(abs(a.logprob - b.logprob) for a, b in zip(eager, traced))
    real = sum(p.request.real_tokens for p in prepared)
    print(f"traced results identical to the same plan run eagerly: {same}")
    print(
        f"packed eager vs padded traced: same tokens {[r.token for r in eager] == [r.token for r in traced]}, "
        f"largest token log-prob difference {drift:.1e}"
    )
    print(f"tokens/s: eager {real / eager_s:,.0f} ({eager_s:.2f} s), traced {real / traced_s:,.0f} ({traced_s:.2f} s)")
    executor.close()
    print(f"live device tensors after close: {len(runtime.backend.ledger.live())}")
    if not same:
        raise SystemExit("traced results differ from eager")
