"""The cached-prefix case of ``prefill_throughput.py``: 32 prompts of 20-2000 tokens, random cached prefixes.

Each row's cached prefix is a random whole number of 16-token blocks below
its length (zero for about one row in four). Ours prefills the prefixes once,
untimed, then runs the rows with them cached. Transformers, as a
knowledgeable user would, runs each row's uncached tokens over its own
``DynamicCache`` holding its prefix (clones made outside the timed region,
as in the SmolLM2 chat case); both are timed on the same uncached tokens.
"""

from __future__ import annotations

import copy
import random
import time

import torch

__all__ = ["CACHED_CASE", "HFCachedRows", "cached_prompts"]

CACHED_CASE = "cached32_20-2000"
BLOCK = 16


def cached_prompts(count: int = 32) -> tuple[list[int], list[int]]:
    """``(lengths, cached)``: seeded, so every run times the same rows."""
    rng = random.Random(4242)
    lengths = [rng.randint(20, 2000) for _ in range(count)]
    cached = [0 if rng.random() < 0.25 else BLOCK * rng.randint(0, (n - 1) // BLOCK) for n in lengths]
    return lengths, cached


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


class HFCachedRows:
    """Transformers, one row at a time, each over a fresh clone of its prefix cache; returns its own seconds."""

    self_timed = True

    def __init__(self, model, tokens: torch.Tensor, lengths: list[int], cached: list[int]):
        self.model, self.lengths, self.cached = model, lengths, cached
        with torch.inference_mode():
            self.prefixes = [
                _cache_of(model(tokens[i : i + 1, :c], use_cache=True)) if c else None for i, c in enumerate(cached)
            ]

    def __call__(self, tokens: torch.Tensor) -> float:
        clones = [copy.deepcopy(p) for p in self.prefixes]  # untimed: a serving engine's cache is already there
        start = time.perf_counter()
        with torch.inference_mode():
            for i, (n, c) in enumerate(zip(self.lengths, self.cached)):
                self.model(tokens[i : i + 1, c:n], past_key_values=clones[i], use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start
