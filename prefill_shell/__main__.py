"""``python -m prefill_shell run``: see ``prefill_shell.cli.main``."""

from prefill_shell.cli.main import main

main()
