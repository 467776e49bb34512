"""Log-likelihood scoring for evals: ``scorer`` (``Scorer``: continuation and rolling scores
over a block pool, shared prefixes computed once), ``prefix_sharing`` (which rows
share which whole blocks), and ``lm_eval_model`` (the ``prefill-runtime`` model
for lm-evaluation-harness; needs lm-eval installed, so it is not
imported here). Independent of ``prefill_shell.serving``.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch

from prefill_shell.scoring.scorer import Scorer

__all__ = ["Scorer"]
