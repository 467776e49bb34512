#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment for one declared
# Python (3.12 by default; `scripts/ensure-venv.sh 3.10` for the other) and
# prints its path on stdout (progress goes to stderr).
#
# The venv lives outside the clone, keyed by the interpreter version and a
# hash of the dependency list in pyproject.toml, so CI clones share one
# ~6 GB environment per Python instead of each building its own. The project
# itself is not installed into it: the Makefile puts the clone on PYTHONPATH,
# so one venv serves any clone.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
version="${1:-3.12}"
case "$version" in
    3.10|3.12) ;;
    *) echo "error: the project declares Python 3.10 and 3.12 (ttnn's wheels), not $version" >&2; exit 1 ;;
esac
root="${PREFILL_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/prefill-runtime}"

find_python() {
    local candidates=()
    local override="PYTHON${version/./}"
    [[ -n "${!override:-}" ]] && candidates+=("${!override}")
    local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
    command -v pyenv >/dev/null 2>&1 && pyenv_root="$(pyenv root)"
    # Never the pyenv shim: it fails unless PYENV_VERSION is set.
    candidates+=("$pyenv_root"/versions/"$version".*/bin/python"$version")
    candidates+=(/usr/local/bin/python"$version" /usr/bin/python"$version")
    for c in "${candidates[@]}"; do
        if [[ -x "$c" ]] && "$c" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$version'" 2>/dev/null; then
            echo "$c"; return 0
        fi
    done
    return 1
}

py="$(find_python)" || {
    echo "error: no Python $version found (ttnn ships wheels for 3.10 and 3.12 only); set PYTHON${version/./}=/path/to/python$version" >&2
    exit 1
}
# tomllib arrived in 3.11: read the dependency list with whichever Python has it.
reader="$py"
"$py" -c 'import tomllib' 2>/dev/null || reader="$(command -v python3)"
reqs="$("$reader" - "$here/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = list(project["dependencies"])
for extra in ("shell", "text", "dev"):
    reqs += project["optional-dependencies"][extra]
print("\n".join(reqs))
PY
)"
hash="$(printf '%s\n' "$reqs" | sha256sum | cut -c1-12)"
venv="$root/venv-py${version/./}-$hash"
if [[ -f "$venv/.ready" ]]; then
    echo "$venv"
    exit 0
fi

# One builder at a time: a second caller waits for the first, then reuses.
mkdir -p "$root"
exec 9>"$venv.lock"
flock 9
if [[ -f "$venv/.ready" ]]; then
    echo "$venv"
    exit 0
fi
echo "creating $venv with $py (torch + ttnn: several GB, a few minutes)" >&2
rm -rf "$venv"
"$py" -m venv "$venv" >&2
printf '%s\n' "$reqs" > "$venv/requirements.txt"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$venv/requirements.txt" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
"$venv/bin/python" -c 'import attrs, cattrs, torch, numpy, safetensors, hypothesis, pytest, transformers, gguf, accelerate, importlinter, ttnn; import sys; sys.version_info[:2] != (3, 12) or __import__("lm_eval.evaluator")' >&2
touch "$venv/.ready"
echo "$venv"
