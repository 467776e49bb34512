"""Shared fixtures for the runtime's end-to-end tests: the tiny model, its HF oracle, runtimes, page tables.

The oracle is ``transformers.LlamaForCausalLM`` loaded in float32 from the
very weights the reference model holds; each row is run through it alone,
unpadded, so every runtime result is compared with an independent answer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch

from prefill_core import PrefillPolicy
from prefill_shell.backends import TorchBackend
from prefill_shell.config import PrefillRuntimeConfig
from prefill_shell.reference import PagedKVCache, random_llama, save_hf_folder
from prefill_shell.runtime import PrefillRuntime

TOL = 1e-4
"""Largest absolute difference accepted between runtime and oracle values."""

VOCAB = 256

SMALL_POLICY = PrefillPolicy(max_chunk_length=256, chunk_quantum=128, length_ladder=(128, 256))
"""Chunks at 256 tokens, so rows longer than that are chunked at short, cheap lengths."""


@pytest.fixture(scope="session")
def tiny_model():
    """The seeded tiny preset, with positions for 8192 tokens so a 5000-token row fits its capacity."""
    return random_llama(0, "tiny", max_position_embeddings=8192)


@pytest.fixture(scope="session")
def oracle(tiny_model, tmp_path_factory):
    """An ``Oracle`` over transformers' Llama holding ``tiny_model``'s weights."""
    transformers = pytest.importorskip("transformers")
    folder = save_hf_folder(tiny_model, tmp_path_factory.mktemp("tiny_hf"))
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return Oracle(hf)


class Oracle:
    """Runs one unpadded row through HF and memoizes its last-token logits and KV cache."""

    def __init__(self, hf):
        self.hf = hf
        self._memo: dict[tuple[int, ...], tuple[torch.Tensor, list, list]] = {}

    def _run(self, tokens: torch.Tensor):
        key = tuple(tokens.tolist())
        if key not in self._memo:
            with torch.no_grad():
                out = self.hf(tokens[None], use_cache=True)
            cache = out["cache"] if "cache" in out else out["past_key_values"]
            keys = [layer.keys[0].clone() for layer in cache.layers]  # [H_kv, S, D] per layer
            values = [layer.values[0].clone() for layer in cache.layers]
            self._memo[key] = (out.logits[0, -1].clone(), keys, values)
        return self._memo[key]

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 ``[V]`` logits of the row's last token."""
        return self._run(tokens)[0]

    def kv(self, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the row's post-RoPE keys and values ``[H_kv, len, D]``."""
        _, keys, values = self._run(tokens)
        return keys, values


def make_tokens(length: int, seed: int) -> torch.Tensor:
    """A row of ``length`` seeded tokens in ``[1, VOCAB)`` (never 0, the padding token)."""
    return torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def token_matrix(rows: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Rows right-padded with zeros into an int64 ``[N, T]`` matrix."""
    width = max(len(r) for r in rows) if width is None else width
    out = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def assign_blocks(
    lengths: Sequence[int], block_size: int, num_blocks: int, seed: int, reserved=(0,)
) -> list[list[int]]:
    """Disjoint, shuffled block lists (one per row) covering each row's length; ``reserved`` ids are never used."""
    reserved = set(reserved)
    free = [b for b in range(num_blocks) if b not in reserved]
    random.Random(seed).shuffle(free)
    out = []
    for length in lengths:
        need = -(-length // block_size)
        if need > len(free):
            raise AssertionError(f"pool of {num_blocks} blocks is too small for lengths {list(lengths)}")
        out.append(free[:need])
        free = free[need:]
    return out


def page_table(
    blocks: Sequence[Sequence[int]], width: int | None = None, tails: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """An int32 page table; each row's blocks are followed by its ``tails`` entry (default ``-1``s)."""
    width = max(len(b) for b in blocks) if width is None else width
    table = torch.full((len(blocks), width), -1, dtype=torch.int32)
    for i, row in enumerate(blocks):
        entries = list(row) + (list(tails[i]) if tails is not None else [])
        entries = entries[:width]
        table[i, : len(entries)] = torch.tensor(entries, dtype=torch.int32)
    return table


def randomize_pool(kv: PagedKVCache, seed: int) -> None:
    """Fills every block (sink included) with seeded noise, so stray writes show up."""
    gen = torch.Generator().manual_seed(seed)
    for pool in kv.keys + kv.values:
        pool.copy_(torch.randn(pool.shape, generator=gen))


def row_kv(kv: PagedKVCache, layer: int, blocks: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[0, length)`` of one row read through its blocks: ``[H_kv, length, D]`` each."""
    ids = torch.tensor(list(blocks))

    def unpage(pool: torch.Tensor) -> torch.Tensor:
        part = pool[ids]  # [nb, H_kv, bs, D]
        return part.transpose(0, 1).reshape(part.shape[1], -1, part.shape[3])[:, :length]

    return unpage(kv.keys[layer]), unpage(kv.values[layer])


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item()


def build_runtime(
    model, *, num_blocks: int, block_size: int, policy: PrefillPolicy | None = None, backend=None, seed: int = 0
) -> PrefillRuntime:
    """A runtime over a fresh zeroed pool; its pool is ``runtime.config.kv``."""
    kv = model.new_kv_cache(num_blocks, block_size)
    config = PrefillRuntimeConfig.resolve(model, backend or TorchBackend(), kv, policy=policy)
    return PrefillRuntime(config, seed=seed)


@pytest.fixture(scope="session")
def kit():
    """This module's helpers and constants as one namespace (conftest modules are not importable)."""
    return SimpleNamespace(
        TOL=TOL,
        VOCAB=VOCAB,
        SMALL_POLICY=SMALL_POLICY,
        make_tokens=make_tokens,
        token_matrix=token_matrix,
        assign_blocks=assign_blocks,
        page_table=page_table,
        randomize_pool=randomize_pool,
        row_kv=row_kv,
        max_abs_diff=max_abs_diff,
        build_runtime=build_runtime,
    )
