"""Sampling on torch tensors: one row's top-k/top-p/temperature draw and ranked top log-probs
(``torch_sampling``), and the vLLM-style presence/frequency/repetition penalties (``penalties``).

Below the backends: the torch backend samples with these, and the ttnn
emulation uses them where ttnn ships no reference sampler.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch
