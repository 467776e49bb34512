"""Every generic entry point given a ``HybridLlama`` (a windowed model) serves it: one page table per call.

Once ``ServingFacade``, ``LaneGroupFacade``, the scoring runtime and the
command line's ``make_runtime`` all reached ``new_kv_cache(num_blocks,
block_size)``, which passed the block size to the hybrid model's ``device``
argument ("Found no NVIDIA driver"). Now every model's pool takes
``(num_blocks, block_size)`` alike (a buffer per layer for a hybrid model), and
the runtime serves one page table for every KV group, so each entry's result
equals transformers on the same weights (a Ministral: sliding, full, sliding).
"""

from __future__ import annotations

import math

import pytest
import torch

from prefill_shell.backends import TorchBackend
from prefill_shell.cli.main import make_runtime
from prefill_shell.reference.windows.hybrid import HybridLlama
from prefill_shell.scoring.scorer import Scorer
from prefill_shell.scoring.setup import scoring_runtime
from prefill_shell.serving.facade import ServingFacade
from prefill_shell.serving.lane_facade import LaneGroupFacade
from tests import window_kit as kit

pytest.importorskip("transformers")

WINDOW, BLOCK = 24, 16


@pytest.fixture(scope="module")
def hybrid():
    base, hf, types = kit.model_and_oracle("ministral", WINDOW)
    return HybridLlama(base, kit.attention_of(types, WINDOW, BLOCK, block_size=BLOCK)), hf


def _prompts(model, lengths, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, model.spec.vocab_size, (n,), generator=gen) for n in lengths]


def _call(prompts):
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.int64)
    table = torch.full((len(prompts), 8), -1, dtype=torch.int32)
    next_block = 1
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
        need = -(-len(p) // BLOCK)
        table[row, :need] = torch.arange(next_block, next_block + need)
        next_block += need
    return tokens, table


def _expected(hf, prompt):
    with torch.no_grad():
        return hf(prompt[None]).logits[0, -1]


@pytest.mark.parametrize("entry", ["facade", "lane_group"])
@pytest.mark.parametrize("enable_trace", [False, True])
def test_the_serving_facades_serve_a_windowed_model(hybrid, entry, enable_trace):
    """prefill_forward with one page_table (and no page_tables_per_layer) equals transformers, on 1 and 2 lanes."""
    model, hf = hybrid
    if entry == "facade":
        facade = ServingFacade(model, TorchBackend(), max_seq_len=128, max_batch_size=4)
    else:
        facade = LaneGroupFacade([(model, TorchBackend()), (model, TorchBackend())], max_seq_len=128)
    spec = model.spec
    facade.allocate_kv_cache((48, spec.num_kv_heads, BLOCK, spec.head_dim), model.dtype, spec.num_layers)
    facade.warmup_model_prefill(kv_cache=facade.kv, can_sample_on_device=False, enable_trace=enable_trace)
    prompts = _prompts(model, [70, 33, 100])
    tokens, table = _call(prompts)
    lengths = [len(p) for p in prompts]
    out = facade.prefill_forward(tokens, table, enable_trace=enable_trace, prompt_lens=lengths, kv_cache=facade.kv)
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(out[row, -1], _expected(hf, prompt), atol=kit.TOL, rtol=kit.TOL)
    facade.cleanup()


def test_the_scorer_and_the_command_lines_runtime_serve_a_windowed_model(hybrid):
    """scoring_runtime + Scorer: a continuation's log-likelihood equals transformers'; make_runtime builds."""
    model, hf = hybrid
    runtime = scoring_runtime(model, "cpu", max_length=120, block_size=BLOCK, max_chunk=64)
    context, continuation = (p.tolist() for p in _prompts(model, [60, 9], seed=9))
    (score,) = Scorer(runtime).score([(context, continuation)])
    full = torch.tensor(context + continuation)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(full[None]).logits[0].double(), dim=-1)
    want = sum(logprobs[len(context) - 1 + i, t].item() for i, t in enumerate(continuation))
    assert math.isclose(score.logprob, want, rel_tol=1e-4, abs_tol=1e-4)

    class Batch:  # what make_runtime reads of a SharedPrefixBatch
        num_blocks, max_blocks_per_row = 32, 8

    cli_runtime = make_runtime(model, Batch(), BLOCK)
    prompts = _prompts(model, [50])
    tokens, table = _call(prompts)
    (result,) = cli_runtime.prefill(tokens, table, [50])
    torch.testing.assert_close(result.logits, _expected(hf, prompts[0]), atol=kit.TOL, rtol=kit.TOL)
