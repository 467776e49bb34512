"""Two runtimes over the same bfloat16 reference Llama: ttnn on the EMULATION (``ReferenceEmulation``,
with the TTTv2 adapter over the stand-in model) and the torch backend, plus the call arguments they share."""

from __future__ import annotations

import functools

import torch

from prefill_core import PrefillPolicy
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.reference import random_llama
from tests.helpers import build_runtime
from tests.tt.reference_standin import ReferenceLlamaStandIn
from tests.tt.tt_report import note

POLICY = PrefillPolicy(length_ladder=(128,), max_chunk_length=128, chunk_quantum=128)
"""The ttnn tests' policy (not tests.helpers.CHUNK_256_POLICY): they count 128-token chunks, a 300-token row runs 3."""
BLOCK, NUM_BLOCKS = 32, 64
TOLERANCE = 0.02
"""Relative to the largest logit: a few bfloat16 ulps (8 bits of mantissa)."""


@functools.lru_cache(maxsize=1)
def reference_llama():
    """The tiny preset in bfloat16 (vocab 256, hidden 64, GQA): the model both lanes run."""
    return random_llama(0, "tiny", dtype="bfloat16")


class EmulatedLane:
    """``TtnnBackend`` + ``TtModelAdapter`` + stand-in model on a fresh ``ReferenceEmulation``."""

    def __init__(self, ttnn):
        from prefill_shell.tt.adapter import TtModelAdapter
        from prefill_shell.tt.backend import TtnnBackend
        from prefill_shell.tt.emulation import ReferenceEmulation

        llama = reference_llama()
        self.emu = ReferenceEmulation(ttnn)
        self.kv = llama.new_kv_cache(NUM_BLOCKS, BLOCK)
        self.standin = ReferenceLlamaStandIn(self.emu, llama, self.kv)
        self.model = TtModelAdapter(self.standin, llama.spec, mesh_device=self.emu.mesh, ttnn_module=self.emu)
        self.backend = TtnnBackend(self.emu.mesh, ttnn_module=self.emu)
        self.executor = PrefillExecutor(build_runtime(self.model, policy=POLICY, backend=self.backend, kv=self.kv))


def torch_executor() -> PrefillExecutor:
    """The same model on the torch backend (CPU), its own KV pool."""
    llama = reference_llama()
    return PrefillExecutor(build_runtime(llama, num_blocks=NUM_BLOCKS, block_size=BLOCK, policy=POLICY))


def call_args(lengths, cached=None, sampling=None, seed=1) -> dict:
    """Random prompts of ``lengths`` with consecutive blocks from 1 (block 0 stays unused)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = reference_llama().spec.vocab_size
    tokens = torch.randint(1, vocab, (len(lengths), max(lengths)), generator=gen)
    table = torch.full((len(lengths), 16), -1, dtype=torch.int32)
    block = 1
    for row, length in enumerate(lengths):
        need = -(-length // BLOCK)
        table[row, :need] = torch.arange(block, block + need, dtype=torch.int32)
        block += need
    return dict(
        tokens=tokens,
        page_table=table,
        prompt_lengths=list(lengths),
        cached_lengths=cached,
        sampling=None if sampling is None else [sampling] * len(lengths),
    )


def assert_logits_close(case: str, got, want) -> None:
    """Each row's logits within ``TOLERANCE`` of the largest reference logit; the worst difference is noted."""
    worst = 0.0
    for g, w in zip(got, want):
        diff = (g.logits - w.logits).abs().max().item()
        assert diff <= TOLERANCE * w.logits.abs().max().item(), f"{case}: row {g.row} logits differ by {diff}"
        worst = max(worst, diff)
    note(f"{case}: max |logit difference| {worst:.3g} over {len(got)} rows")
