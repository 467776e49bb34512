"""vLLM's top-k / top-p support on one row, written from its rule in plain Python floats (an oracle).

The rule, read from vllm-project/vllm ``vllm/v1/sample/ops/topk_topp_sampler.py``
at v0.33.0 (``apply_top_k_only`` and ``apply_top_k_top_p_pytorch``, the path
its CPU sampler takes): logits are divided by the temperature; top-k masks
every logit below the k-th largest (``logits < kth``), so ties with the k-th
stay; top-p sorts the survivors ascending (a stable sort: equal logits by
ascending id), takes the cumulative softmax and masks every position whose
cumulative mass is ``<= 1 - p``, except the last (the largest). ``top_k`` 0 or
at least the vocabulary, and ``top_p`` 1, are no limit.
"""

from __future__ import annotations

import math

# Cumulative masses this close to 1 - p are left out of comparisons: float rounding decides them, not the rule.
AMBIGUOUS = 1e-9


def vllm_support(logits: list[float], top_k: int, top_p: float, temperature: float) -> tuple[set[int], bool]:
    """(kept token ids, whether a top-p boundary lies within ``AMBIGUOUS`` of a cumulative mass)."""
    scaled = [x / temperature for x in logits]
    kept = set(range(len(scaled)))
    if 0 < top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        kept = {i for i in kept if not scaled[i] < kth}
    ambiguous = False
    if top_p < 1.0:
        order = sorted(kept, key=lambda i: (scaled[i], i))  # ascending, equal logits by ascending id
        top = max(scaled[i] for i in order)
        weights = [math.exp(scaled[i] - top) for i in order]
        total = math.fsum(weights)
        cumulative = 0.0
        for position, (i, w) in enumerate(zip(order, weights, strict=True)):
            cumulative += w / total
            ambiguous |= abs(cumulative - (1.0 - top_p)) < AMBIGUOUS
            if cumulative <= 1.0 - top_p and position < len(order) - 1:
                kept.discard(i)
    return kept, ambiguous
