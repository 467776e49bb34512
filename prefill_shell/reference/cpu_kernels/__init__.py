"""The CPU attention kernel of packed steps: ``flash.c``, built on first use (``library.py``), called per
layer over a whole step (``flash.py``)."""
