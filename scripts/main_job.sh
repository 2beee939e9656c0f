#!/usr/bin/env bash
# Set up, then train a LoRA on the embedded default through a headless ComfyUI (tools/main_job.py).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh"
exec "${INGRAPH_VENV:-$REPO/.venv}/bin/python" "$REPO/tools/main_job.py" "$@"
