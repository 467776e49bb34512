"""How every scoring entry point builds its runtime: one layout, one policy, one planning rule.

The ``score`` command line and the lm-eval model both score through a
``Scorer`` on a runtime built here, so the same request is planned the same
way under either (packed steps where the backend and model run them, the
padded waves a trace serves when the scorer replays; ``prefill_core.values.execution``).
"""

from __future__ import annotations

import attrs

from prefill_core import PrefillPolicy
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.runtime import PrefillRuntime
from prefill_shell.scoring.scorer import scoring_layout

__all__ = ["scoring_policy", "scoring_runtime"]


def scoring_policy(block_size: int, max_chunk: int) -> PrefillPolicy:
    """The fine-rung policy with packed steps asked for: scoring rows are long and ragged."""
    return attrs.evolve(PrefillPolicy.fine_rungs(block_size, max_chunk_length=max_chunk), packed_steps=True)


def scoring_runtime(
    model, device: str, *, max_length: int, block_size: int, max_chunk: int, num_blocks: int | None = None
) -> PrefillRuntime:
    """A torch runtime on ``device`` for rows of ``max_length + 1`` tokens (``scoring_layout``'s pool)."""
    layout = scoring_layout(max_length, block_size, num_blocks)
    kv = model.new_kv_cache(layout.num_blocks, block_size)
    policy = scoring_policy(block_size, max_chunk)
    return PrefillRuntime(PrefillRuntimeConfig.resolve(model, TorchBackend(device), kv, layout=layout, policy=policy))
