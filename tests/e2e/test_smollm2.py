"""The runtime on the real SmolLM2-135M-Instruct GGUF against transformers loading the same file (float32).

Every prompt is a prefix of one long real-text document, so one transformers
forward over the longest prompt yields the oracle for all of them: the
last-token logits at each prompt's final position (a causal model's output
there depends on nothing later) and every prompt's K/V (the first ``n``
positions of the cache). The runtime runs each block size in two calls:
every prompt uncached, then the cached variants, whose prefix blocks are the
uncached run's blocks of one prompt (as a serving engine's cache would be).
Each case runs twice: padded waves and packed steps (``prefill_core.planning.packed``;
short prompts with a 256-token step budget, so rows split across steps).

Tolerances: logits within 1e-4 of the largest logit magnitude; argmax equal
where transformers' top-2 margin exceeds twice that; K/V within 1e-4 of the
largest K/V magnitude of the row.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, PrefillPolicy, RequestKind, SamplingParams
from prefill_shell.backends import TorchBackend
from prefill_shell.cli.demo import document
from tests.helpers import build_runtime

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

REL_TOL = 1e-4
SHORT = (1, 127, 128, 129, 300)
LONG = (511, 512, 513, 1100)
LONG_MAX_CHUNK = 512
"""The long prompts' max chunk: the chunk boundaries of tt-metal's 2048 at a quarter of the tokens (the tiny
Llama's oracle tests cross 2048 itself; here every position costs a real model's forward on a 2-core CPU)."""
# Cached prefix per prompt length: a whole number of blocks below the length,
# or all of it for a block-aligned prompt (a fully cached row re-runs its last block).
SHORT_CACHED = {
    16: {127: 112, 128: 128, 129: 128, 300: 288},
    32: {127: 96, 128: 128, 129: 128, 300: 288},
    64: {127: 64, 128: 128, 129: 128, 300: 256},
}
LONG_CACHED = {511: 256, 512: 512, 513: 512, 1100: 512}


@pytest.fixture(scope="session")
def doc_tokens(smollm2_tokenizer) -> torch.Tensor:
    """A real-text document of at least max(LONG) tokens."""
    ids = smollm2_tokenizer(document(lines=80))["input_ids"]
    assert len(ids) >= max(LONG)
    return torch.tensor(ids[: max(LONG)], dtype=torch.int64)


class Oracle(NamedTuple):
    logits: dict[int, torch.Tensor]  # prompt length -> float32 [V] at its last position
    keys: torch.Tensor  # [L, H_kv, T, D]
    values: torch.Tensor


@pytest.fixture(scope="session")
def oracle(smollm2_hf, doc_tokens) -> Oracle:
    """One transformers forward over the whole document, logits kept at every tested prompt's last position."""
    lengths = sorted(set(SHORT + LONG))
    with torch.no_grad():
        out = smollm2_hf(doc_tokens[None], use_cache=True, logits_to_keep=torch.tensor([n - 1 for n in lengths]))
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return Oracle({n: out.logits[0, i].float() for i, n in enumerate(lengths)}, keys, values)


class RowCheck(NamedTuple):
    length: int
    cached: int
    logits_err: float
    logits_scale: float
    margin: float  # transformers' top-1 minus top-2 logit
    argmax_equal: bool
    kv_err: float
    kv_scale: float


def _check_row(kv, blocks: list[int], length: int, cached: int, logits: torch.Tensor, oracle: Oracle) -> RowCheck:
    """Compares one row's logits and its K/V, read from the pool through its blocks, with the oracle."""
    ids = torch.tensor(blocks)
    kv_err = kv_scale = 0.0
    for layer, (k_pool, v_pool) in enumerate(zip(kv.keys, kv.values)):
        for pool, expected in ((k_pool, oracle.keys[layer]), (v_pool, oracle.values[layer])):
            part = pool[ids]  # [nb, H_kv, bs, D] -> [H_kv, nb*bs, D]
            ours = part.transpose(0, 1).reshape(part.shape[1], -1, part.shape[3])[:, :length]
            kv_err = max(kv_err, (ours - expected[:, :length]).abs().max().item())
            kv_scale = max(kv_scale, expected[:, :length].abs().max().item())
    hf = oracle.logits[length]
    top2 = hf.topk(2).values
    return RowCheck(
        length,
        cached,
        (logits - hf).abs().max().item(),
        hf.abs().max().item(),
        (top2[0] - top2[1]).item(),
        logits.argmax().item() == hf.argmax().item(),
        kv_err,
        kv_scale,
    )


def run_case(
    model,
    doc: torch.Tensor,
    oracle: Oracle,
    bs: int,
    lengths,
    cached_of: dict[int, int],
    prefix_from: int,
    packed: bool,
    budget: int | None = None,
    max_chunk: int | None = None,
) -> tuple[list[RowCheck], list[RowCheck]]:
    """Runs ``lengths`` uncached, then each ``cached_of`` variant reading ``prefix_from``'s blocks as its cache.

    ``packed``: packed steps of at most ``budget`` tokens (the policy's max chunk when None), else padded waves.
    ``max_chunk``: the backend's preferred policy rebuilt at this max chunk (None: as the backend prefers).
    """
    need = [-(-n // bs) for n in lengths]
    own = [-(-n // bs) - c // bs for n, c in cached_of.items()]
    num_blocks = sum(need) + sum(own)
    layout = PageTableLayout(bs, -(-model.spec.max_position // bs), num_blocks)
    kv = model.new_kv_cache(num_blocks, bs)
    policy = TorchBackend().preferred_policy(bs)
    if max_chunk is not None:
        policy = attrs.evolve(PrefillPolicy.fine_rungs(bs, max_chunk_length=max_chunk), packed_steps=True)
    if budget is not None:
        policy = attrs.evolve(policy, max_chunk_length=budget)
    runtime = build_runtime(model, kv=kv, layout=layout, policy=policy)
    assert runtime.config.packed_steps
    starts = [sum(need[:i]) for i in range(len(lengths))]
    rows = [list(range(s, s + k)) for s, k in zip(starts, need)]
    uncached = _call(runtime, doc, lengths, rows, [0] * len(lengths), oracle, packed)
    source = rows[lengths.index(prefix_from)]
    first, cached_rows = sum(need), []
    for c, k in zip(cached_of.values(), own):
        cached_rows.append(source[: c // bs] + list(range(first, first + k)))
        first += k
    cached = _call(runtime, doc, list(cached_of), cached_rows, list(cached_of.values()), oracle, packed)
    runtime.close()
    return uncached, cached


def _call(runtime, doc, lengths, rows, cached, oracle, packed: bool) -> list[RowCheck]:
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    table = torch.full((len(lengths), max(len(r) for r in rows)), -1, dtype=torch.int32)
    for i, (n, blocks) in enumerate(zip(lengths, rows)):
        tokens[i, :n] = doc[:n]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    batch = runtime.prepare(tokens, table, lengths, cached, mode="eager" if packed else "traced")
    assert all((p.request.kind is RequestKind.PACKED) == packed for p in batch.requests)
    results = runtime.assemble(runtime.invocations(batch), len(lengths))
    kv = runtime.config.kv
    return [_check_row(kv, rows[r.row], lengths[r.row], cached[r.row], r.logits, oracle) for r in results]


def assert_matches(checks: list[RowCheck]) -> None:
    for c in checks:
        where = f"length {c.length}, cached {c.cached}"
        # Shown with -s: the figures the tolerances are judged against.
        print(
            f"{where}: logits {c.logits_err:.2e} of {c.logits_scale:.1f}, K/V {c.kv_err:.2e} of {c.kv_scale:.1f}, "
            f"top-2 margin {c.margin:.3f}, argmax equal {c.argmax_equal}"
        )
        assert c.logits_err <= REL_TOL * c.logits_scale, f"{where}: logits differ by {c.logits_err:.2e}"
        if c.margin > 2 * REL_TOL * c.logits_scale:
            assert c.argmax_equal, f"{where}: argmax differs with top-2 margin {c.margin:.3f}"
        assert c.kv_err <= REL_TOL * c.kv_scale, f"{where}: K/V differ by {c.kv_err:.2e} (scale {c.kv_scale:.1f})"


MODES = {"padded": False, "packed": True}


@pytest.fixture(
    scope="session", params=[(bs, m) for bs in (16, 32, 64) for m in MODES], ids=lambda p: f"block{p[0]}-{p[1]}"
)
def short_case(request, smollm2, doc_tokens, oracle):
    """Prompts of 1-300 tokens at one block size, padded or packed: (uncached checks, cached checks)."""
    bs, mode = request.param
    packed = MODES[mode]
    return run_case(
        smollm2, doc_tokens, oracle, bs, list(SHORT), SHORT_CACHED[bs], 300, packed, 256 if packed else None
    )


@pytest.fixture(scope="session", params=list(MODES))
def long_case(request, smollm2, doc_tokens, oracle):
    """Prompts of 511-1100 tokens at block size 32, max chunk 512 (chunked past it): (uncached, cached checks)."""
    packed = MODES[request.param]
    return run_case(smollm2, doc_tokens, oracle, 32, list(LONG), LONG_CACHED, 512, packed, max_chunk=LONG_MAX_CHUNK)


def test_short_prompts_uncached_match_transformers(short_case):
    """Uncached prompts of 1, 127, 128, 129 and 300 tokens match transformers' logits and K/V."""
    assert_matches(short_case[0])


def test_short_prompts_with_cached_prefix_match_transformers(short_case):
    """The same prompts run over a cached block-aligned prefix (one fully cached) match transformers."""
    assert_matches(short_case[1])


def test_long_prompts_uncached_match_transformers(long_case):
    """Uncached prompts of 511, 512, 513 and 1100 tokens (the last two chunked at 512) match transformers."""
    assert_matches(long_case[0])


def test_long_prompts_with_cached_prefix_match_transformers(long_case):
    """Those prompts over cached prefixes of 256 or 512 tokens (512 fully cached) match transformers."""
    assert_matches(long_case[1])


def test_capital_of_france_is_paris(smollm2, smollm2_tokenizer):
    """'The capital of France is' prefilled by the runtime gives ' Paris' as the most likely next token."""
    ids = smollm2_tokenizer("The capital of France is")["input_ids"]
    runtime = build_runtime(smollm2, num_blocks=1, block_size=32)
    (result,) = runtime.prefill(
        torch.tensor([ids]),
        torch.tensor([[0]], dtype=torch.int32),
        [len(ids)],
        sampling=[SamplingParams.greedy(num_logprobs=3)],
    )
    assert smollm2_tokenizer.decode([result.token]) == " Paris"
    assert [smollm2_tokenizer.decode([t]) for t, _ in result.top_logprobs] == [" Paris", " the", " London"]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_prompt_logprobs_match_transformers_log_softmax(smollm2, smollm2_hf, doc_tokens, traced):
    """Prompt log-probs of a 160-token row with 64 cached, in 64-token chunks at block 16: transformers' within 1e-4."""

    tokens = doc_tokens[:160]
    with torch.no_grad():
        want = torch.log_softmax(smollm2_hf(tokens[None]).logits[0].float(), dim=-1)  # [160, V]
    layout = PageTableLayout(16, 10, 10)
    runtime = build_runtime(smollm2, layout=layout, policy=PrefillPolicy.fine_rungs(16, max_chunk_length=64))
    table = torch.arange(10, dtype=torch.int32)[None]
    runtime.prefill(tokens[None, :64], table[:, :4], [64])  # the cached prefix
    sampling = [SamplingParams.greedy(prompt_logprobs=1, prompt_start=70)]
    mode = "traced" if traced else "eager"
    batch = runtime.prepare(tokens[None], table, [160], [64], sampling=sampling, mode=mode)
    if traced:
        for prepared in batch.requests:
            runtime.capture(prepared.trace_signature)
            runtime.allocate_workspace(prepared.program_signature)
    (result,) = runtime.assemble(runtime.invocations(batch, mode=mode), 1)
    entries = result.prompt_logprobs
    assert [e.position for e in entries] == list(range(71, 160))
    worst = max(abs(e.logprob - want[e.position - 1, e.token].item()) for e in entries)
    assert worst <= 1e-4, worst
    assert all(e.top[0][0] == int(want[e.position - 1].argmax()) for e in entries)
