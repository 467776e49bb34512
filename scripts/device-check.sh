#!/usr/bin/env bash
# GPU first contact, in about 4 minutes on one H200: the CUDA-marked tests, then traced (CUDA graphs) vs
# eager and ours vs transformers at bfloat16 (benchmarks/device_check.py), one JSON and one table.
#
# The device machine is bare and offline: python3 with torch, numpy 2.x, transformers, safetensors, attrs,
# pytest and hypothesis, but no cattrs, gguf or this project's venv. So this script never calls make, pip
# against an index, or the network, never imports ttnn (tests/tt is not collected), and installs the
# wheels carried in .whl/ (fetched here, where pip reaches PyPI, by `scripts/device-check.sh --fetch-wheels`).
#
#   scripts/device-check.sh --fetch-wheels   # here, once: .whl/ (git-ignored) gets cattrs
#   device run: command "scripts/device-check.sh", carry [".whl"], timeout_s 360
#   python benchmarks/device_check.py --readme <files_at>/device_check.json   # into results/, benchmarks/README.md regenerated
#
# Without CUDA (here) it is a dry run: the CUDA-marked tests are collected and skip, and the benchmark's
# flow runs on the CPU with the tiny preset; it exits 0 and says it skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(cattrs==26.2.1)
if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
    ls -l .whl
    exit 0
fi

PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$(mktemp -d)}
LOG="$OUT_DIR/device_check.log"
START=$SECONDS
say() { echo "[device-check $((SECONDS - START))s] $*" | tee -a "$LOG"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HYPOTHESIS_PROFILE=ci

"$PY" - <<'EOF' | tee -a "$LOG"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "bf16", torch.cuda.is_bf16_supported())
from importlib.metadata import version
import attrs, cattrs, safetensors, transformers  # what the project needs beyond torch: a missing one stops here
print(*(f"{name} {version(name)}" for name in ("attrs", "cattrs", "safetensors", "transformers", "numpy")))
EOF

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    CUDA=1
else
    CUDA=0
fi

say "CUDA-marked tests (tests/shell; tests/tt is not collected: no ttnn)"
set +e
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/shell --junitxml="$OUT_DIR/cuda_tests.xml" 2>&1 \
    | tail -n 30 | tee -a "$LOG"
TESTS=${PIPESTATUS[0]}
set -e
if [[ $TESTS != 0 && $TESTS != 5 ]]; then say "CUDA-marked tests failed (status $TESTS); benchmarks still run"; fi

if [[ $CUDA == 0 ]]; then
    say "no CUDA device: dry run of the benchmark flow on the CPU (tiny preset)"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} timeout 300 "$PY" benchmarks/device_check.py --dry-run --budget-s 4 \
        --out "$OUT_DIR" 2>&1 | grep -v '^Loading weights' | tee -a "$LOG"
    say "skipped: no CUDA device here (dry run passed; results in $OUT_DIR)"
    exit 0
fi

say "traced vs eager, ours vs transformers at bfloat16 (benchmarks/device_check.py)"
timeout 200 "$PY" benchmarks/device_check.py --budget-s 90 --out "$OUT_DIR" 2>&1 \
    | grep -v '^Loading weights' | tee -a "$LOG"
say "done: $OUT_DIR/device_check.json, $OUT_DIR/device_check.md (tests status $TESTS)"
exit "$TESTS"
