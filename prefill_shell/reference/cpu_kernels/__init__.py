"""The reference model's CPU kernels: a packed step's attention (``flash.py``), its rotary and pool writes
(``rope.py``) and RMSNorm (``rms_norm.py``), from C sources built on first use (``library.py``)."""
