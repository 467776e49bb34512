"""What the runtime asks of a device and a model, and who owns what: the shell's bottom layer.

``contract`` names every staged tensor and its spec (the host/device boundary
both backends and the ttnn adapter implement), ``model`` the model protocol
the runtime borrows (``PrefillModel``, ``ModelSpec``), ``ledger`` the single
owner of every device tensor the runtime creates, and ``notes`` how a cleanup
failure is attached to a primary error. Imports only ``prefill_core``.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch
