"""The command lines: ``main`` (``prefill-run`` / ``python -m prefill_shell run``, and the
``score`` subcommand), ``args`` (the shared parser and its one-line failures),
``score`` (``prefill-score``), ``demo`` (``make demo``), and
``lm_eval_harness`` (``prefill-lm-eval``: lm-eval's own CLI with the model registered).
The top layer: nothing else in the shell imports it.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch
