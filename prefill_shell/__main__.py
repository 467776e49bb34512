"""``python -m prefill_shell run``: see ``prefill_shell.cli``."""

from .cli import main

main()
