"""Hypothesis profiles: ``ci`` (default, sized for 2 cores), ``fuzz`` (50x the examples) and ``fuzz-core``.

Select with HYPOTHESIS_PROFILE=ci|fuzz|fuzz-core (the Makefile's ``test``, ``fuzz`` and ``fuzz-core``).
``fuzz-core`` is one round of the fuzz stage (``tests/fuzz_plugin.py``): randomized, and without an example
database, so a round is fixed by its seed alone and its printed command replays it anywhere.

The model fixtures (``tests/model_fixtures.py``: the tiny model, its transformers oracle, the real SmolLM2) are
registered here, at the root, so every folder's tests share one session copy of each; they need torch, which
``make test-core``'s light venv lacks, and tests/core takes none of them.
"""

import importlib.util
import os

from hypothesis import HealthCheck, settings

CI_EXAMPLES = 60
FUZZ_EXAMPLES = CI_EXAMPLES * 50
FUZZ_ROUND_EXAMPLES = 25  # a round is the fuzz stage's unit of time: small, so its budget holds on a loaded machine

settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz",
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz-core",
    max_examples=FUZZ_ROUND_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

if importlib.util.find_spec("torch") is not None:
    from tests.model_fixtures import *  # noqa: F403  (fixtures register by name)
