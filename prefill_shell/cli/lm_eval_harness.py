"""``prefill-lm-eval <lm-eval arguments>`` (or ``python -m prefill_shell.cli.lm_eval_harness``): lm-eval's own
CLI with the ``prefill-runtime`` model registered.

Example: ``prefill-lm-eval --model prefill-runtime --model_args model=smollm2,max_length=512
--tasks evals/prefill_mc.yaml``. The model itself is ``prefill_shell.scoring.lm_eval_model``.
"""

from __future__ import annotations

from prefill_shell.extras import LM_EVAL_PYTHONS, requires_extra

__all__ = ["main"]


def main() -> None:
    """Register ``prefill-runtime`` with lm-eval, then run lm-eval's command line on ``sys.argv``."""
    with requires_extra("lm-eval", "prefill-lm-eval", pythons=LM_EVAL_PYTHONS):
        from lm_eval.__main__ import cli_evaluate

    import prefill_shell.scoring.lm_eval_model  # noqa: F401 (importing it registers "prefill-runtime")

    cli_evaluate()


if __name__ == "__main__":
    main()
