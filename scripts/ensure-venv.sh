#!/usr/bin/env bash
# Creates (or reuses) the project's Python 3.12 virtual environment and prints
# its path on stdout (progress goes to stderr).
#
# The venv lives outside the clone, keyed by a hash of the dependency list in
# pyproject.toml, so CI clones share one ~6 GB environment instead of each
# building its own. The project itself is not installed into it: the
# Makefile puts the clone on PYTHONPATH, so one venv serves any clone.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="${PREFILL_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/prefill-runtime}"

find_python312() {
    local candidates=()
    [[ -n "${PYTHON312:-}" ]] && candidates+=("$PYTHON312")
    local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
    command -v pyenv >/dev/null 2>&1 && pyenv_root="$(pyenv root)"
    # Never the pyenv shim: it fails unless PYENV_VERSION is set.
    candidates+=("$pyenv_root/versions/3.12.1/bin/python3.12" "$pyenv_root"/versions/3.12.*/bin/python3.12)
    candidates+=(/usr/local/bin/python3.12 /usr/bin/python3.12)
    for c in "${candidates[@]}"; do
        if [[ -x "$c" ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$c"; return 0
        fi
    done
    return 1
}

py="$(find_python312)" || {
    echo "error: no Python 3.12 found (ttnn ships wheels for 3.10 and 3.12 only); set PYTHON312=/path/to/python3.12" >&2
    exit 1
}
reqs="$("$py" - "$here/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = list(project["dependencies"])
for extra in ("shell", "dev"):
    reqs += project["optional-dependencies"][extra]
print("\n".join(reqs))
PY
)"
hash="$(printf '%s\n' "$reqs" | sha256sum | cut -c1-12)"
venv="$root/venv-py312-$hash"
if [[ -f "$venv/.ready" ]]; then
    echo "$venv"
    exit 0
fi

echo "creating $venv with $py (torch + ttnn: several GB, a few minutes)" >&2
mkdir -p "$root"
rm -rf "$venv"
"$py" -m venv "$venv" >&2
printf '%s\n' "$reqs" > "$venv/requirements.txt"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$venv/requirements.txt" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
"$venv/bin/python" -c 'import attrs, cattrs, torch, numpy, safetensors, hypothesis, pytest, transformers' >&2
touch "$venv/.ready"
echo "$venv"
