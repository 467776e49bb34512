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

.PHONY: venv venvs model demo test test-vllm test-core fuzz-core lint lint-imports test-py312 test-py310 test-tt fuzz bench explain

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

# vLLM 0.33's own scheduler, KV cache manager and grouping driving the facade as
# the Tenstorrent plugin does (tests/vllm), in a venv of vLLM --no-deps over the
# 3.12 one (scripts/ensure-vllm-venv.sh; `make test` skips tests/vllm).
test-vllm: model
	venv="$$(scripts/ensure-vllm-venv.sh)"; \
	OMP_NUM_THREADS=1 $(ENV) "$$venv/bin/python" $(PYTEST) tests/vllm

# The laptop path: tests/core on any CPython >= 3.10 (PYTHON=/path/to/python3.x
# picks it; python3 by default) in a light venv of the core's dependencies and
# the test-core extra (scripts/ensure-venv.sh core: ~40 MB, no torch, no model).
test-core:
	venv="$$(PYTHON='$(PYTHON)' scripts/ensure-venv.sh core)"; \
	echo "tests/core on $$("$$venv/bin/python" -VV) ($$venv)"; \
	PYTHONPATH=$(CURDIR) PYTHONDONTWRITEBYTECODE=1 HYPOTHESIS_PROFILE=ci "$$venv/bin/python" $(PYTEST) tests/core

# The fuzz stage (.ci/run runs it after `make test`): every hypothesis property of
# tests/core, randomized from a fresh seed (printed first; FUZZ_SEED=N repeats a
# run), in two processes (one core each) of FUZZ_SECONDS each, each property in
# rounds of 25 examples for its share of the time (tests/fuzz_plugin.py). A
# failure prints its example and the one command that reproduces it. The `ci`
# profile of `make test` stays the regression suite. Runs in the core's light venv.
FUZZ_SECONDS ?= 165
fuzz-core:
	@venv="$$(PYTHON='$(PYTHON)' scripts/ensure-venv.sh core)"; \
	seed="$${FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"; \
	echo "fuzz-core: seed $$seed (FUZZ_SEED=N make fuzz-core reuses a seed), 2 shards of $(FUZZ_SECONDS) s, $$("$$venv/bin/python" -V)"; \
	$(MAKE) --no-print-directory -j2 --output-sync=target FUZZ_VENV="$$venv" FUZZ_SEED="$$seed" fuzz-core-shard-0 fuzz-core-shard-1

fuzz-core-shard-%:
	PYTHONPATH=$(CURDIR) PYTHONDONTWRITEBYTECODE=1 HYPOTHESIS_PROFILE=fuzz-core "$(FUZZ_VENV)/bin/python" \
	    -m pytest -q -p no:cacheprovider -p tests.fuzz_plugin --tb=short \
	    --fuzz-seed=$(FUZZ_SEED) --fuzz-seconds=$(FUZZ_SECONDS) --fuzz-shard=$*/2 tests/core

# Tests that need a Tenstorrent device; they skip with a reason without one.
test-tt:
	HYPOTHESIS_PROFILE=ci $(RUN) $(PYTEST) -m tt_device tests/tt

# The same suites with at least 50x the CI examples.
fuzz:
	HYPOTHESIS_PROFILE=fuzz $(RUN) $(PYTEST)

# Every benchmark; each prints a table and writes benchmarks/results/<name>.json, then
# benchmarks/README.md is written from those files.
BENCHES = plan_overhead plan_cost runtime_overhead host_forms staging masked_reads prefill_throughput trace_replay reliability vs_vllm_cpu
bench:
	for b in $(BENCHES); do $(RUN) benchmarks/$$b.py $(BENCH_ARGS) || exit 1; done
	$(RUN) benchmarks/report_readme.py

# Explain a plan of a sample batch (override LENGTHS / CACHED).
LENGTHS ?= 100,4097,15x128
CACHED ?= 0,2048,0
explain:
	$(RUN) -m prefill_core plan --lengths $(LENGTHS) --cached $(CACHED)
