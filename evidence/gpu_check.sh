#!/usr/bin/env bash
# The one-command GPU check: GPU drafts equal CPU drafts, and GPU draft latency on the Qwen3-1.7B
# shape. Run on the machine with the GPU, from a clone of this repository; arguments go to gpu_check.py.
#
#   bash evidence/gpu_check.sh [--json gpu_check.json]
#
# A GPU machine's own python3 is used as it is when its torch sees a CUDA device (such machines often
# reach no package registry; the check needs torch, transformers, safetensors and huggingface_hub);
# elsewhere the repository's .venv is created or reused.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python=python3
if ! python3 -c "import torch, transformers, safetensors; raise SystemExit(not torch.cuda.is_available())" 2>/dev/null; then
    "$repo/scripts/ensure_venv.sh"
    python="$repo/.venv/bin/python"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$python" "$repo/evidence/bench/gpu_check.py" "$@"
