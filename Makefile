# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create what is missing and reuse what is present: the Python 3.12
# environment (and for `make test` the 3.10 one too; scripts/ensure-venv.sh)
# and the real model file (scripts/ensure-model.sh).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV = $(shell scripts/ensure-venv.sh 3.12)
VENV310 = $(shell scripts/ensure-venv.sh 3.10)
MODEL = $(shell scripts/ensure-model.sh)
ENV = PYTHONPATH=$(CURDIR) PYTHONDONTWRITEBYTECODE=1 PREFILL_SMOLLM2=$(MODEL)
RUN = $(ENV) $(VENV)/bin/python
PYTEST = -m pytest -q -p no:cacheprovider --durations=15

.PHONY: venv venvs model demo test test-core lint lint-imports test-py312 test-py310 test-tt fuzz bench explain

# Prints the interpreter to use (the 3.12 venv's python).
venv:
	@echo $(VENV)/bin/python

# Fetches the model once (fails loudly when it cannot), then prints its path.
model:
	@scripts/ensure-model.sh

demo: model
	$(RUN) -m prefill_shell run

# Formatting and lint (pyproject's [tool.ruff]), the import layers
# (pyproject's [tool.importlinter]), then the whole suite on every Python the
# package declares, 3.12 and 3.10 side by side: each suite is one process that
# keeps about one core busy, so on two cores the pair takes as long as the
# slower one. Each runs with one torch thread (two suites of two threads each
# would oversubscribe the cores), and make prints each suite's output whole
# when that suite ends (--output-sync). Both venvs are built first, in turn.
test: model lint lint-imports venvs
	$(MAKE) --no-print-directory -j2 --output-sync=target OMP_NUM_THREADS=1 test-py312 test-py310

venvs:
	@echo "python 3.12: $(VENV)"
	@echo "python 3.10: $(VENV310)"

lint:
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

lint-imports:
	$(ENV) $(VENV)/bin/lint-imports --no-cache

test-py312:
	HYPOTHESIS_PROFILE=ci $(if $(OMP_NUM_THREADS),OMP_NUM_THREADS=$(OMP_NUM_THREADS)) $(RUN) $(PYTEST)

test-py310:
	HYPOTHESIS_PROFILE=ci $(if $(OMP_NUM_THREADS),OMP_NUM_THREADS=$(OMP_NUM_THREADS)) $(ENV) $(VENV310)/bin/python $(PYTEST)

# The laptop path: tests/core on any CPython >= 3.10 (PYTHON=/path/to/python3.x
# picks it; python3 by default) in a light venv of the core's dependencies and
# the test-core extra (scripts/ensure-venv.sh core: ~40 MB, no torch, no model).
test-core:
	venv="$$(PYTHON='$(PYTHON)' scripts/ensure-venv.sh core)"; \
	echo "tests/core on $$("$$venv/bin/python" -VV) ($$venv)"; \
	PYTHONPATH=$(CURDIR) PYTHONDONTWRITEBYTECODE=1 HYPOTHESIS_PROFILE=ci "$$venv/bin/python" $(PYTEST) tests/core

# Tests that need a Tenstorrent device; they skip with a reason without one.
test-tt:
	HYPOTHESIS_PROFILE=ci $(RUN) $(PYTEST) -m tt_device tests/tt

# The same suites with at least 50x the CI examples.
fuzz:
	HYPOTHESIS_PROFILE=fuzz $(RUN) $(PYTEST)

# Every benchmark; each prints a table and writes benchmarks/results/<name>.json.
BENCHES = plan_overhead plan_cost runtime_overhead host_forms staging masked_reads prefill_throughput trace_replay reliability
bench:
	for b in $(BENCHES); do $(RUN) benchmarks/$$b.py $(BENCH_ARGS) || exit 1; done

# Explain a plan of a sample batch (override LENGTHS / CACHED).
LENGTHS ?= 100,4097,15x128
CACHED ?= 0,2048,0
explain:
	$(RUN) -m prefill_core plan --lengths $(LENGTHS) --cached $(CACHED)
