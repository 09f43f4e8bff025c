#!/usr/bin/env bash
# Create (first run) or reuse the repository's virtual environment, .venv, and install this project into it.
#
#   scripts/ensure_venv.sh        # what serving needs (serve.sh calls this)
#   scripts/ensure_venv.sh dev    # plus the test dependencies (run_tests.sh calls this)
#
# torch comes first: a machine without nvidia-smi gets torch==2.13.0, for which the build machines hold a
# CPU wheel (an unpinned torch would pull the multi-GB CUDA build); a machine with a GPU gets the ordinary build.
# A stamp per extras set in .venv remembers the pyproject.toml it installed; while that matches, nothing is
# installed again, so later runs start at once and work offline (an install with extras also satisfies a
# plain one). PYTHON picks the interpreter (>= 3.11).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
extras="${1:-}"
spec="."
[[ -n "$extras" ]] && spec=".[$extras]"
stamp="$venv/.installed${extras:+-$extras}"
fingerprint="$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)"

installed() {  # installed STAMP: did STAMP record this pyproject.toml?
    [[ -f "$1" && "$(cat "$1")" == "$fingerprint" ]]
}
if installed "$stamp"; then
    exit 0
fi
if [[ -z "$extras" ]]; then
    for other in "$venv"/.installed-*; do
        if installed "$other"; then exit 0; fi
    done
fi

if [[ ! -x "$venv/bin/python" ]]; then
    python="${PYTHON:-python3}"
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "ensure_venv: Python >= 3.11 needed; $python is $("$python" --version 2>&1). Set PYTHON=/path/to/python3.11" >&2
        exit 1
    fi
    echo "ensure_venv: creating $venv" >&2
    "$python" -m venv "$venv"
fi

if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        "$venv/bin/python" -m pip install torch
    else
        "$venv/bin/python" -m pip install torch==2.13.0
    fi
fi
echo "ensure_venv: installing $spec into $venv" >&2
(cd "$repo" && "$venv/bin/python" -m pip install --quiet -e "$spec")
echo "$fingerprint" > "$stamp"
