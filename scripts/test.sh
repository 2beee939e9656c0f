#!/usr/bin/env bash
# Set up, then run the whole test suite (unit, trainer program, ComfyUI tiers) against ComfyUI 0.3.64 (COMFYUI_PATH),
# then the ComfyUI 0.33 tier (COMFYUI_033_PATH; skipped with one line where absent). Arguments (tests to run,
# pytest flags) go to both runs, in place of the 0.33 tier's list; INGRAPH_033_TESTS replaces that list,
# INGRAPH_SKIP_033=1 leaves the tier out.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh"
cd "$REPO"
VENV="${INGRAPH_VENV:-$REPO/.venv}"
COMFYUI_033_PATH="${COMFYUI_033_PATH:-/opt/ComfyUI-0.33}"
# the 0.33 tier: everything that meets ComfyUI's interfaces (its loaders, model classes, ops, quantized layouts,
# server, frontend) through the shipped workflows, each family's loader and the pack's wrappers
TIER_033="${INGRAPH_033_TESTS:-tests/test_comfy_compat.py tests/test_quantized_bases.py tests/test_comfyui_training.py
  tests/test_evaluation.py tests/test_distill_graph.py tests/test_fp8.py tests/test_load_memory.py
  tests/test_model_families.py tests/test_web_panel.py tests/test_templates.py}"

status=0
start=$SECONDS
"$VENV/bin/python" -m pytest -v "$@" || status=$?
echo "test.sh: ComfyUI $(cat "${COMFYUI_PATH:-/opt/ComfyUI}/comfyui_version.py" 2>/dev/null | grep -o '[0-9][0-9.]*' || echo '?'): whole suite in $((SECONDS - start)) s (exit $status)"

if [ "${INGRAPH_SKIP_033:-0}" = "1" ]; then
  echo "test.sh: skipped: the ComfyUI 0.33 tier (INGRAPH_SKIP_033=1)"
elif [ ! -f "$COMFYUI_033_PATH/main.py" ]; then
  echo "test.sh: skipped: ComfyUI 0.33 not found at $COMFYUI_033_PATH (set COMFYUI_033_PATH)"
else
  start=$SECONDS
  tier_status=0
  # shellcheck disable=SC2086,SC2048
  COMFYUI_PATH="$COMFYUI_033_PATH" PYTHONPATH="$VENV/comfyui-0.33${PYTHONPATH:+:$PYTHONPATH}" \
    INGRAPH_TEST_ARTIFACTS="$REPO/test-artifacts/comfyui-0.33" INGRAPH_SKIP_DISTILL_QUALITY=1 \
    "$VENV/bin/python" -m pytest -v ${*:-$TIER_033} || tier_status=$?
  echo "test.sh: ComfyUI 0.33 tier in $((SECONDS - start)) s (exit $tier_status)"
  [ "$tier_status" = 0 ] || status=$tier_status
fi
exit "$status"
