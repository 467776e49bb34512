"""Hypothesis profiles: ``ci`` (default, sized for 2 cores) and ``fuzz`` (50x the examples).

Select with HYPOTHESIS_PROFILE=ci|fuzz (the Makefile's ``test`` and ``fuzz``).
"""

import os

from hypothesis import HealthCheck, settings

CI_EXAMPLES = 60
FUZZ_EXAMPLES = CI_EXAMPLES * 50

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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
