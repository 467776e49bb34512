"""``prefill-lm-eval <lm-eval arguments>`` (or ``python -m prefill_shell.cli.lm_eval_harness``): lm-eval's own
CLI with the ``prefill-runtime`` model registered.

Example: ``prefill-lm-eval --model prefill-runtime --model_args model=smollm2,max_length=512
--tasks evals/prefill_mc.yaml``. The model itself is ``prefill_shell.scoring.lm_eval_model``.

With ``--model prefill-runtime`` its model arguments (and ``--device``) are
checked as the other command lines check theirs, before lm-eval loads
anything: a value that breaks its rule is one ``error:`` line naming it, and
exit status 2.
"""

from __future__ import annotations

import sys

from prefill_shell.extras import LM_EVAL_PYTHONS, requires_extra

__all__ = ["main"]


def main() -> None:
    """Register ``prefill-runtime`` with lm-eval, check its arguments, then run lm-eval's command line."""
    with requires_extra("lm-eval", "prefill-lm-eval", pythons=LM_EVAL_PYTHONS):
        from lm_eval._cli import HarnessCLI  # what lm_eval.__main__.cli_evaluate runs, with the check between
        from lm_eval.utils import setup_logging

    from prefill_core.values.errors import PrefillConfigError
    from prefill_shell.scoring.lm_eval_model import check_model_arguments  # importing it registers the model

    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    if getattr(args, "model", None) == "prefill-runtime":
        given = dict(getattr(args, "model_args", None) or {})
        if getattr(args, "device", None) is not None:
            given.setdefault("device", args.device)
        try:
            check_model_arguments(**given)
        except PrefillConfigError as error:
            print(f"error: --model_args: {error} (see `prefill-lm-eval --help`)", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    parser.execute(args)


if __name__ == "__main__":
    main()
