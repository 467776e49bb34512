"""``python -m prefill_shell run``: the main job (see ``prefill_shell.demo``)."""

from .demo import main

main()
