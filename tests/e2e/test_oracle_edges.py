"""Edges a real client reaches where an answer can be silently wrong, checked against transformers and across modes."""

from __future__ import annotations

import attrs
import pytest
import torch

from prefill_core import PageTableLayout, SamplingParams
from prefill_shell.reference import save_hf_folder
from prefill_shell.reference.llama_like.llama import PagedLlama
from prefill_shell.sampling.torch_sampling import top_logprobs
from tests.helpers import CHUNK_256_POLICY, assign_blocks, build_runtime, make_tokens, page_table, token_matrix

BS = 16
LAYOUT = PageTableLayout(BS, 32, 64)
PROMPT = make_tokens(40, 5)
"""Position 39 of ``PROMPT + TAIL`` predicts the token after the prompt: the tied position."""
TAIL = torch.tensor([5, 6])
TIE_OFFSETS = (-20, -7, 7, 20)
"""The argmax's LM-head row is copied to these ids around it: five tokens share the top logit exactly."""


@pytest.fixture(scope="module")
def tied(tiny_model, oracle, tmp_path_factory):
    """The tiny model with five identical LM-head rows, its transformers twin, and the tied ids in order."""
    best = int(oracle.logits(PROMPT).argmax())
    weights = {name: value.clone() for name, value in tiny_model.weights.items()}
    head = weights["lm_head.weight"]
    for offset in TIE_OFFSETS:
        head[(best + offset) % head.shape[0]] = head[best]
    model = PagedLlama(tiny_model.config, weights)
    transformers = pytest.importorskip("transformers")
    folder = save_hf_folder(model, tmp_path_factory.mktemp("tied_hf"))
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(PROMPT[None]).logits[0, -1]
    ids = (logits == logits.max()).nonzero().flatten().tolist()
    assert len(ids) == 1 + len(TIE_OFFSETS) and int(logits.argmax()) == ids[0]  # exact ties, argmax the lowest
    return model, ids


def _ranked(values: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` best ``(id, value)`` by value, equal values by ascending id: written out in Python."""
    pairs = sorted(enumerate(values.tolist()), key=lambda pair: (-pair[1], pair[0]))
    return pairs[:n]


@pytest.mark.parametrize("seed", range(4))
def test_top_logprobs_rank_equal_values_by_ascending_token_id(seed):
    """Logits with many exact ties (small integers): the top-N lists equal a Python sort by (value desc, id asc)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (5, 300), generator=gen).float()
    logits[1] = 0.0  # every token tied
    tokens = logits.argmax(-1)
    for n in (1, 2, 7, 40):
        _, ids, values = top_logprobs(logits, tokens, n)
        logp = torch.log_softmax(logits, dim=-1)
        for row in range(logits.shape[0]):
            assert list(zip(ids[row].tolist(), values[row].tolist())) == _ranked(logp[row], n), (row, n)
            assert ids[row, 0] == tokens[row]  # the first entry is the greedy token


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_tied_top_lists_are_the_lowest_ids_whatever_rides_in_the_call(tied, packed):
    """Five tokens tie for the top logit: the greedy token, the first top-log-prob entry and the prompt log-prob
    top list are transformers' argmax and the lowest tied ids, alone or beside a row asking more alternatives."""
    model, ids = tied
    row = torch.cat((PROMPT, TAIL))
    mate = make_tokens(30, 9)
    policy = attrs.evolve(CHUNK_256_POLICY, packed_steps=packed)
    asked = SamplingParams.greedy(num_logprobs=3, prompt_logprobs=3, prompt_start=len(PROMPT) - 1)
    for mates in (0, 1):
        rows = [row] + [mate] * mates
        lengths = [len(r) for r in rows]
        runtime = build_runtime(model, layout=LAYOUT, policy=policy)
        table = page_table(assign_blocks(lengths, BS, LAYOUT.num_blocks, seed=1))
        sampling = [asked] + [SamplingParams.greedy(num_logprobs=5, prompt_logprobs=5)] * mates
        batch = runtime.prepare(token_matrix(rows), table, lengths, sampling=sampling)
        result = runtime.assemble(runtime.invocations(batch), batch.num_rows)[0]
        (entry,) = [e for e in result.prompt_logprobs if e.position == len(PROMPT)]
        assert [token for token, _ in entry.top] == ids[:3], mates
    # The last-token output of the prompt alone: its greedy token heads its own top list.
    runtime = build_runtime(model, layout=LAYOUT, policy=policy)
    (result,) = runtime.prefill(PROMPT[None], page_table([[1, 2, 3]]), [len(PROMPT)], sampling=[asked])
    assert result.token == ids[0] and [token for token, _ in result.top_logprobs] == ids[:3]


def test_host_sampled_row_top_list_does_not_depend_on_wave_mates(tied):
    """A host-path row's top-1 list is the lowest tied id, beside a mate whose num_logprobs is larger or not."""
    model, ids = tied
    own = SamplingParams(temperature=0.5, top_k=0, seed=3, num_logprobs=1)
    lists = []
    for mate_logprobs in (0, 5):
        rows = [PROMPT, make_tokens(30, 9)]
        runtime = build_runtime(model, layout=LAYOUT, policy=CHUNK_256_POLICY)
        table = page_table(assign_blocks([40, 30], BS, LAYOUT.num_blocks, seed=2))
        mate = SamplingParams(temperature=0.5, top_k=0, seed=4, num_logprobs=mate_logprobs)
        results = runtime.prefill(token_matrix(rows), table, [40, 30], sampling=[own, mate])
        lists.append(results[0].top_logprobs)
    assert [token for token, _ in lists[0]] == [token for token, _ in lists[1]] == ids[:1]


TRUST_ROWS = ((100, 40), (48, 48), (45, 45), (90, 64))
"""(length, cached): cached inside a block, fully cached at and off a block edge, cached at a block edge."""


def _run_with_noise(tiny_model, mode: str, noise_end) -> tuple[list, list[torch.Tensor]]:
    """Fills each row's cache, then runs it with tokens ``[0, noise_end(length, cached))`` replaced by noise."""
    rows = [make_tokens(length, 60 + length) for length, _ in TRUST_ROWS]
    lengths, cached = [length for length, _ in TRUST_ROWS], [c for _, c in TRUST_ROWS]
    policy = attrs.evolve(CHUNK_256_POLICY, packed_steps=mode == "packed")
    runtime = build_runtime(tiny_model, layout=LAYOUT, policy=policy)
    table = page_table(assign_blocks(lengths, BS, LAYOUT.num_blocks, seed=2))
    tokens = token_matrix(rows)
    runtime.prefill(tokens, table, cached)  # the prefix cache, true to the tokens
    gen = torch.Generator().manual_seed(9)
    for i, (length, c) in enumerate(TRUST_ROWS):
        end = noise_end(length, c)
        tokens[i, :end] = torch.randint(1, 256, (end,), generator=gen)
    run = "traced" if mode == "traced" else "eager"
    batch = runtime.prepare(tokens, table, lengths, cached, sampling=SamplingParams.greedy(num_logprobs=2), mode=run)
    if mode == "traced":
        for prepared in batch.requests:
            runtime.capture(prepared.trace_signature)
            runtime.allocate_workspace(prepared.program_signature)
    results = runtime.assemble(runtime.invocations(batch, mode=run), batch.num_rows)
    return results, [pool.clone() for pool in runtime.config.kv.keys + runtime.config.kv.values]


@pytest.mark.parametrize("mode", ["packed", "padded", "traced"])
def test_tokens_before_the_block_a_row_resumes_in_are_never_read(tiny_model, mode):
    """Noise in the tokens before the block holding min(cached, length - 1) changes no result and no KV byte."""
    clean, clean_kv = _run_with_noise(tiny_model, mode, lambda length, cached: 0)
    noisy, noisy_kv = _run_with_noise(tiny_model, mode, lambda length, cached: min(cached, length - 1) // BS * BS)
    assert noisy == clean
    assert all(torch.equal(a, b) for a, b in zip(noisy_kv, clean_kv))
