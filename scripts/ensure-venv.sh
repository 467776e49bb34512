#!/usr/bin/env bash
# Creates (or reuses) a virtual environment and prints its path on stdout
# (progress goes to stderr):
#
#   scripts/ensure-venv.sh [3.12|3.10]  the whole suite's venv for one declared
#                                       Python (torch, ttnn, transformers, lm-eval:
#                                       ~6 GB); 3.12 by default
#   scripts/ensure-venv.sh core         the core's light venv (attrs, cattrs and the
#                                       test-core extra: ~40 MB, no torch) on any
#                                       CPython >= 3.10: $PYTHON, else python3
#
# A venv lives outside the clone, keyed by the interpreter version and a hash
# of its requirement lines in pyproject.toml (for `core`, also the
# interpreter's path), so CI clones share one environment per Python instead of
# each building its own, and a dependency change builds a new one. The project
# itself is not installed into it: the Makefile puts the clone on PYTHONPATH,
# so one venv serves any clone.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
kind="${1:-3.12}"
root="${PREFILL_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/prefill-runtime}"

# A full venv's interpreter: PYTHON312 / PYTHON310, pyenv's, then the system's.
find_declared_python() {
    local version="$1" candidates=()
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

case "$kind" in
    3.10|3.12)
        py="$(find_declared_python "$kind")" || {
            echo "error: no Python $kind found (ttnn ships wheels for 3.10 and 3.12 only); set PYTHON${kind/./}=/path/to/python$kind" >&2
            exit 1
        }
        extras="shell tt text dev"
        name="venv-py${kind/./}"
        check='import attrs, cattrs, torch, numpy, safetensors, hypothesis, pytest, transformers, gguf, accelerate, importlinter, ttnn; import sentence_transformers; import sys; sys.version_info[:2] != (3, 12) or __import__("lm_eval.evaluator")'
        ;;
    core)
        given="${PYTHON:-python3}"
        # The real interpreter behind a name or a pyenv shim; the venv links to it.
        py="$("$given" -c 'import os, sys; assert sys.version_info >= (3, 10); print(os.path.realpath(sys.executable))' 2>/dev/null)" || {
            echo "error: PYTHON=$given is not a CPython >= 3.10 that runs; set PYTHON=/path/to/python3.x (3.10 or later)" >&2
            exit 1
        }
        extras="test-core"
        name="venv-core-py$("$py" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
        check='import attrs, cattrs, hypothesis, pytest'
        ;;
    *)
        echo "error: scripts/ensure-venv.sh takes 3.12, 3.10 (the whole suite's Pythons) or core, not $kind" >&2
        exit 1
        ;;
esac

# tomllib arrived in 3.11: read pyproject.toml with whichever Python has it.
reader="$py"
"$py" -c 'import tomllib' 2>/dev/null || reader="$(command -v python3)"
# The core's dependencies, then each extra's lines, with an extra that names
# prefill-runtime[other] expanded in place (pip resolves those only when
# installing the project, which these venvs never do).
reqs="$("$reader" - "$here/pyproject.toml" $extras <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]

def expand(lines):
    for line in lines:
        own = re.fullmatch(r"prefill-runtime\[([\w,-]+)\]", line)
        if own is None:
            yield line
        else:
            for extra in own.group(1).split(","):
                yield from expand(extras[extra])

reqs = list(project["dependencies"])
for extra in sys.argv[2:]:
    reqs += expand(extras[extra])
print("\n".join(reqs))
PY
)"
key="$reqs"
[[ "$kind" == core ]] && key="$py"$'\n'"$reqs"
hash="$(printf '%s\n' "$key" | sha256sum | cut -c1-12)"
venv="$root/$name-$hash"
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
echo "creating $venv with $py ($extras)" >&2
rm -rf "$venv"
"$py" -m venv "$venv" >&2
printf '%s\n' "$reqs" > "$venv/requirements.txt"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$venv/requirements.txt" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
"$venv/bin/python" -c "$check" >&2
touch "$venv/.ready"
echo "$venv"
