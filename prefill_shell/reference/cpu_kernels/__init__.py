"""The reference model's CPU kernels: a packed step's attention (``flash.py``), its rotary and pool writes
(``rope.py``) and bfloat16 RMSNorm (``rms_norm.py``), from C sources built on first use (``library.py``)."""
