"""vLLM's penalty rules written out token by token in float64: the oracle of the penalty tests (torch and ttnn)."""

from __future__ import annotations


def reference_penalties(logits, prompt, output, repetition, presence, frequency) -> list[float]:
    """vLLM's rules written out token by token in float64."""
    out = []
    for token, value in enumerate(float(x) for x in logits):
        count = sum(1 for t in output if t == token)
        if token in prompt or count:
            value = value / repetition if value > 0 else value * repetition
        value -= frequency * count
        value -= presence * (1 if count else 0)
        out.append(value)
    return out
