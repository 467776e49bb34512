"""The runtime: plans a batch with ``prefill_core``, runs its steps on a backend, returns results.

``runtime`` (``PrefillRuntime``: prepare, invoke, assemble, cleanup) and
``executor`` (``PrefillExecutor``: warm-up, compile and trace coverage, eager
or traced dispatch) are the public entry points; ``config`` resolves the
static collaborators, ``batch_builder`` turns caller input into a
``PrefillBatch`` once, ``result`` is the returned value, ``call_guard`` keeps
one call at a time, ``progress`` reports long stages. The per-step
collaborators (staging, step loop, traces, postprocessing, readback) live in
``engine.steps`` and are private to this package.
"""

from prefill_shell.extras import require_shell

require_shell(__name__)  # before any module here imports torch
