#!/usr/bin/env bash
# The one-command GPU check: GPU drafts equal CPU drafts, and GPU draft latency on the Qwen3-1.7B
# shape. Run on the machine with the GPU, from a clone of this repository; arguments go to gpu_check.py.
#
#   bash evidence/gpu_check.sh [--json gpu_check.json]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/ensure_venv.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$repo/.venv/bin/python" "$repo/evidence/gpu_check.py" "$@"
