#!/usr/bin/env bash
# Creates (or reuses) the vLLM test venv and prints its path on stdout (progress on stderr).
#
# vLLM 0.33.0 and the pinned pure-Python modules its scheduler needs
# (scripts/vllm-test-requirements.txt) are installed --no-deps into a small
# venv whose site-packages sees the project's 3.12 venv through a .pth file,
# so torch, transformers and ttnn are the project's and no CUDA package is
# fetched. It lives outside the clone beside the others, keyed by the
# requirements file and the project venv's path.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="${PREFILL_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/prefill-runtime}"
base="$("$here/scripts/ensure-venv.sh" 3.12)"
reqs="$here/scripts/vllm-test-requirements.txt"
key="$( (cat "$reqs"; echo "$base") | sha256sum | cut -c1-12)"
venv="$root/venv-vllm-$key"
check='import vllm.v1.core.sched.scheduler, vllm.v1.core.kv_cache_manager, vllm.v1.core.kv_cache_planning, vllm.config, vllm.v1.request, vllm.v1.structured_output'
if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
    echo "$venv"; exit 0
fi
echo "building $venv over $base" >&2
rm -rf "$venv"
py="$("$base/bin/python" -c 'import sys; print(sys._base_executable)')"
"$py" -m venv "$venv"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$base_site" > "$site/prefill-project-venv.pth"
"$venv/bin/python" -m pip install -q --no-deps -r "$reqs" >&2
"$venv/bin/python" -c "$check" >&2
echo "$venv"
