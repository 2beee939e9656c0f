#!/usr/bin/env bash
# Set up, then run the whole test suite (unit, trainer, ComfyUI tiers).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh"
cd "$REPO"
exec "${INGRAPH_VENV:-$REPO/.venv}/bin/python" -m pytest -v "$@"
