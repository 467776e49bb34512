"""Stateless sampling and log-prob helpers shared by the torch backend and host sampling.

One algorithm serves both the device path (torch backend) and the host path
(rows whose top_k exceeds the device cap), so a row's token depends only on
its logits, its parameters and its seed, never on the wave it rode in.

Every accepted parameter is safe here, however extreme: probabilities are
computed in float64 from logits shifted so the largest is 0, so dividing by
a subnormal temperature gives 0 or -inf (never inf - inf = NaN), and a
top-p too small for float32 (1e-46) still keeps the top token.
"""

from __future__ import annotations

import torch

from prefill_core import is_greedy

__all__ = ["sample_row", "support_logits", "top_logprobs", "resolve_generator"]


def resolve_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def support_logits(logits: torch.Tensor, top_k: int, top_p: float, temperature: float) -> torch.Tensor:
    """float64 logits after temperature, top-k and top-p: ``-inf`` outside the support, the largest 0.

    The support is vLLM's (``apply_top_k_top_p_pytorch`` and ``apply_top_k_only``
    in vllm-project/vllm ``vllm/v1/sample/ops/topk_topp_sampler.py`` at v0.33.0,
    the path its CPU sampler takes, which is where a Tenstorrent host samples),
    ties included:

    * top-k keeps every token whose scaled logit is not below the k-th largest,
      so a token tied with the k-th stays (more than k tokens where logits tie);
    * top-p, over the top-k survivors renormalised, drops a token once the mass
      of the tokens ranked above it reaches p, ranking by descending logit and
      equal logits by descending token id (vLLM walks a stable ascending sort,
      so of two equal logits the lower id meets the dropped tail first);
    * the largest logit always stays.
    """
    logits = logits.double()
    # Shifted so the largest logit is 0: (x - max) / T is <= 0 for any T > 0,
    # so a tiny T sends every other token to -inf instead of overflowing to inf.
    scaled = (logits - logits.max()) / temperature
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        # Descending by probability, equal values by descending id: a stable
        # descending sort of the reversed row, its positions mapped back.
        sorted_probs, reversed_order = torch.sort(probs.flip(-1), descending=True, stable=True)
        order = vocab - 1 - reversed_order
        # Drop a token once the mass before it already reaches top_p. The top
        # token always stays, stated outright so that no rounding of top_p can
        # drop it.
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        drop[..., 0] = False
        dropped = torch.zeros_like(drop).scatter_(-1, order, drop)
        scaled = scaled.masked_fill(dropped, float("-inf"))
    return scaled


def sample_row(logits: torch.Tensor, top_k: int, top_p: float, temperature: float, seed: int) -> torch.Tensor:
    """One token (0-d int64 tensor, on the logits' device) from ``logits [V]``.

    Greedy (the argmax) when ``SamplingParams.is_greedy`` says so. Otherwise
    an exponential race (argmax of p / E, E ~ Exp(1) from the row's seeded
    generator), which samples exactly from p with no host sync.
    """
    if is_greedy(temperature, top_k):  # the core's rule: greedy here exactly when the row alone takes argmax
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(support_logits(logits, top_k, top_p, temperature), dim=-1)
    race = torch.empty_like(probs).exponential_(generator=resolve_generator(seed, logits.device))
    # A token outside the support scores -1, below every supported token,
    # even where a draw of E is 0 (0 / 0 would be NaN, which argmax picks).
    score = torch.where(probs > 0, probs / race, -1.0)
    return torch.argmax(score, dim=-1)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int):
    """Log-softmax of the raw logits at ``tokens`` and, if ``top_n``, the top-N (ids, values).

    Equal log-probs rank by ascending token id, so the first entry is the
    argmax (the greedy token, transformers' and lm-eval's ``argmax``) and a
    row's list is the same whatever ``top_n`` its wave or piece computes.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    token_logprob = logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    if top_n <= 0:
        return token_logprob, None, None
    values, ids = torch.topk(logp, min(top_n + 1, logp.shape[-1]), dim=-1)
    # Without two equal values among the top n + 1, the top n and their order are unique. A row with a tie
    # (rare: it takes exactly equal logits) is ranked by a stable sort instead: equal values by ascending id.
    tied = (values[:, 1:] == values[:, :-1]).any(dim=-1)
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        ranked_values, ranked_ids = logp[rows].sort(dim=-1, descending=True, stable=True)
        width = values.shape[1]
        values[rows], ids[rows] = ranked_values[:, :width], ranked_ids[:, :width]
    return token_logprob, ids[:, :top_n], values[:, :top_n]
