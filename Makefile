# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create the Python 3.12 environment when it is missing (see
# scripts/ensure-venv.sh) and reuse it when present.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV = $(shell scripts/ensure-venv.sh)
RUN = PYTHONPATH=$(CURDIR) PYTHONDONTWRITEBYTECODE=1 $(VENV)/bin/python

.PHONY: venv demo test test-tt fuzz bench explain

venv:
	@echo $(VENV)

demo:
	$(RUN) -m prefill_shell run

test:
	HYPOTHESIS_PROFILE=ci $(RUN) -m pytest -q -p no:cacheprovider

# Tests that need a Tenstorrent device; they skip with a reason without one.
test-tt:
	HYPOTHESIS_PROFILE=ci $(RUN) -m pytest -q -p no:cacheprovider -m tt_device tests/tt

# The same suites with at least 50x the CI examples.
fuzz:
	HYPOTHESIS_PROFILE=fuzz $(RUN) -m pytest -q -p no:cacheprovider

bench:
	$(RUN) benchmarks/plan_overhead.py
