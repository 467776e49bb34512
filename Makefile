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

# Every benchmark; each prints a table and writes benchmarks/results/<name>.json.
BENCHES = plan_overhead runtime_overhead staging prefill_throughput trace_replay reliability
bench:
	for b in $(BENCHES); do $(RUN) benchmarks/$$b.py $(BENCH_ARGS) || exit 1; done

# Explain a plan of a sample batch (override LENGTHS / CACHED).
LENGTHS ?= 100,4097,15x128
CACHED ?= 0,2048,0
explain:
	$(RUN) -m prefill_core plan --lengths $(LENGTHS) --cached $(CACHED)
