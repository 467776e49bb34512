"""``python -m prefill_shell run``: see ``prefill_shell.cli.main`` (a missing extra: ``prefill_shell.console``)."""

from prefill_shell.console import module_main

module_main()
