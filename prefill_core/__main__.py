"""``python -m prefill_core plan|manifest|tune``: the command line of ``prefill_core.cli.main``."""

from prefill_core.cli.main import main

if __name__ == "__main__":
    main()
