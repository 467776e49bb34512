"""``python -m prefill_shell.lm_eval <lm-eval arguments>``: lm-eval's own CLI with ``prefill-runtime`` registered.

Example: ``python -m prefill_shell.lm_eval --model prefill-runtime --model_args
model=smollm2,max_length=512 --tasks evals/prefill_mc.yaml``.
"""

from lm_eval.__main__ import cli_evaluate

from . import PrefillRuntimeLM  # noqa: F401 (importing it registers "prefill-runtime")

cli_evaluate()
