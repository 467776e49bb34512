"""The vLLM-like scheduler on the real SmolLM2-135M (its GGUF): five short requests, chunk ends inside blocks.

The prompts are prefixes of one real-text document, so they share cached
blocks, and a 64-token budget cuts them at unaligned positions. Each
request's final-chunk logits, eager and traced, equal a one-shot prefill of
its whole prompt and transformers loading the same file (within 1e-4 of the
largest logit magnitude, as tests/e2e/test_smollm2.py); no KV byte outside
a step's own blocks changes.
"""

from __future__ import annotations

import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_shell.backends import TorchBackend
from prefill_shell.cli.demo import document
from prefill_shell.serving.facade import ServingFacade
from tests.e2e.vllm_like_scheduler import BlockPool, Scheduler, SimRequest, drive

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many small steps: see the fixture

pytest.importorskip("transformers")
pytest.importorskip("gguf")

BLOCK = 16
LENGTHS = (70, 121, 150, 97, 133)
POLICY = PrefillPolicy(max_chunk_length=128, chunk_quantum=128, length_ladder=(128,), waves=(1, 2, 4))
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[torch.Tensor]:
    ids = torch.tensor(smollm2_tokenizer(document(lines=20))["input_ids"][: max(LENGTHS)], dtype=torch.int64)
    return [ids[:n] for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_logits(smollm2_hf, prompts) -> list[torch.Tensor]:
    """One transformers forward over the longest prompt: the logits at each prompt's last position."""
    with torch.no_grad():
        out = smollm2_hf(prompts[LENGTHS.index(max(LENGTHS))][None]).logits[0]
    return [out[n - 1].float() for n in LENGTHS]


@pytest.fixture(scope="module")
def one_shot_logits(smollm2, prompts) -> list[torch.Tensor]:
    """Each prompt prefilled whole, in one eager call of its own."""
    facade = ServingFacade(smollm2, TorchBackend(), max_seq_len=256, max_batch_size=4, policy=POLICY)
    spec = smollm2.spec
    facade.allocate_kv_cache((48, spec.num_kv_heads, BLOCK, spec.head_dim), smollm2.dtype, spec.num_layers)
    out = []
    for tokens in prompts:
        table = torch.arange(-(-len(tokens) // BLOCK), dtype=torch.int32)[None] + 1
        out.append(facade.prefill_forward(tokens[None], table, enable_trace=False)[0, 0])
    return out


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_scheduled_steps_on_smollm2_equal_a_one_shot_prefill_and_transformers(
    smollm2, prompts, hf_logits, one_shot_logits, traced
):
    """Five requests at a 64-token budget (three arriving at once): final-chunk logits match both oracles."""
    facade = ServingFacade(smollm2, TorchBackend(), max_seq_len=256, max_batch_size=4, policy=POLICY)
    spec = smollm2.spec
    kv = facade.allocate_kv_cache((48, spec.num_kv_heads, BLOCK, spec.head_dim), smollm2.dtype, spec.num_layers)
    if traced:  # every trace the layout can plan, captured before the first step (as the plugin warms up)
        facade.warmup_model_prefill(kv_cache=kv, can_sample_on_device=False, enable_trace=True)
    requests = [SimRequest(i, p, arrival=0 if i < 3 else 2 * i, seed=i) for i, p in enumerate(prompts)]
    scheduler = Scheduler(requests, BlockPool(48, BLOCK), budget=64, max_num_seqs=4)
    drive(facade, scheduler, traced=traced)
    assert scheduler.stats["unaligned_starts"] and scheduler.stats["prefix_hit_blocks"], scheduler.stats
    for request, whole, expected in zip(requests, one_shot_logits, hf_logits):
        (logits,) = request.results
        scale = expected.abs().max().item()
        assert (logits - whole).abs().max().item() <= REL_TOL * scale, request.id
        assert (logits - expected).abs().max().item() <= REL_TOL * scale, request.id
