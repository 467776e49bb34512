"""The core's command line (``python -m prefill_core``, ``prefill-plan``): argument parsing, file input and
the tables it prints. The only package of the core that reads files or the process's arguments.
"""
