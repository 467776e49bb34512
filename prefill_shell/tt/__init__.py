"""Everything that imports ``ttnn``: the backend, its host staging and the model adapter.

Named ``tt`` so it can never shadow the ``ttnn`` package. Nothing on the torch
path imports this subpackage; ``ttnn`` is imported when a backend is built.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch
