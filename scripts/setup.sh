#!/usr/bin/env bash
# Set up everything on a fresh machine: ComfyUI (COMFYUI_PATH), a virtual environment with torch
# pinned first, ComfyUI's requirements and this pack's. Safe to run again: it skips what is done.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${INGRAPH_VENV:-$REPO/.venv}"
export COMFYUI_PATH="${COMFYUI_PATH:-/opt/ComfyUI}"
# the newer ComfyUI the ComfyUI tier also runs against (scripts/test.sh); skipped where absent
export COMFYUI_033_PATH="${COMFYUI_033_PATH:-/opt/ComfyUI-0.33}"
PYTHON="${PYTHON:-python3}"
TORCH_PINS="${INGRAPH_TORCH_PINS:-torch==2.14.1 torchvision==0.29.1}"

# torch first, pinned: anything unpinned would pull a multi-GB CUDA build. Where no NVIDIA GPU is found, the CPU
# build comes from PyTorch's CPU index (INGRAPH_CPU_TORCH_INDEX) if that index answers: about 0.2 GB and no nvidia-*
# packages, against about 3 GB for the CUDA build of the default index (the only one PyPI has for Linux x86_64).
# INGRAPH_TORCH_INDEX names the index outright. INGRAPH_SETUP_PLAN=1 prints the choice and stops there.
torch_source() {
  TORCH_INDEX_ARGS=()
  local gpu="no NVIDIA GPU found" cpu_index="${INGRAPH_CPU_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
  { command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia/version ]; } && gpu="an NVIDIA GPU found"
  if [ -n "${INGRAPH_TORCH_INDEX:-}" ]; then
    TORCH_INDEX_ARGS=(--index-url "$INGRAPH_TORCH_INDEX")
    echo "setup: torch: $TORCH_PINS from $INGRAPH_TORCH_INDEX (INGRAPH_TORCH_INDEX; $gpu)" >&2
  elif [ "$gpu" = "no NVIDIA GPU found" ] && "$PYTHON" -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()' "$cpu_index" 2>/dev/null; then
    # the default index stays for everything else; the CPU build ("+cpu") is the newer version of the same pin
    TORCH_INDEX_ARGS=(--extra-index-url "$cpu_index")
    echo "setup: torch: $TORCH_PINS, the CPU build from $cpu_index ($gpu): about 0.2 GB to download," \
         "no nvidia-* packages; the whole environment about 1.5 GB on disk" >&2
  else
    local why="an NVIDIA GPU found"
    [ "$gpu" = "no NVIDIA GPU found" ] && why="no NVIDIA GPU found, but $cpu_index does not answer from here"
    echo "setup: torch: $TORCH_PINS from the default index ($why): the CUDA build, about 3 GB to download," \
         "and the whole environment about 7 GB on disk" >&2
  fi
}
if [ "${INGRAPH_SETUP_PLAN:-0}" = "1" ]; then torch_source; exit 0; fi

if [ ! -f "$COMFYUI_PATH/main.py" ]; then
  echo "setup: ComfyUI not found at $COMFYUI_PATH; trying to clone it" >&2
  git clone --depth 1 https://github.com/comfyanonymous/ComfyUI "$COMFYUI_PATH" >&2 \
    || echo "setup: could not get ComfyUI; set COMFYUI_PATH to an install. ComfyUI tests will be skipped." >&2
fi

# Debian's Chromium for the browser tests of the web extension (playwright drives it; no browser download), only
# when asked (INGRAPH_BROWSER=1): training needs no browser, and those tests skip with one line without one
if [ "${INGRAPH_BROWSER:-0}" = "1" ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
   && [ "$(id -u)" = "0" ]; then
  echo "setup: installing Debian's chromium (INGRAPH_BROWSER=1)" >&2
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
    || echo "setup: could not install chromium; the browser tests will skip" >&2
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# (pip installs without byte-compiling, and what it installed is compiled afterwards on every core (compile_venv):
# ~50 s of CPU that pip spends on one core. It must be compiled: where PYTHONDONTWRITEBYTECODE is set, as on this
# project's machines, Python would otherwise compile each module again in every process that imports it)
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-compile)
compile_venv() {
  # (some packages ship files for other Python versions, torch's py312_intrinsics.py among them: pip compiles what
  # compiles and says nothing of the rest; so does this)
  "$VENV/bin/python" -m compileall -q -j 0 "$VENV/lib" >/dev/null 2>&1 || true
}

comfy_reqs=""
[ -f "$COMFYUI_PATH/requirements.txt" ] && comfy_reqs="$COMFYUI_PATH/requirements.txt"
# ComfyUI's and this pack's own modules byte-compiled, as pip does the environment's: where PYTHONDONTWRITEBYTECODE
# is set (this project's machines), every process importing ComfyUI (a server, each trainer) otherwise compiles its
# ~1,200 files again (~0.4 s of CPU a trainer, more a server start). Python would write the same files itself on a
# first import where the variable is unset. Each run: an updated ComfyUI or pack is compiled again (what is current
# is skipped, ~2 s); what cannot be written or compiled is left to run as it is
for tree in "$COMFYUI_PATH" "$COMFYUI_033_PATH" "$REPO"/*; do  # (the pack's visible entries: not .venv, .git)
  if [ -e "$tree" ]; then
    "$VENV/bin/python" -m compileall -q -j 0 "$tree" >/dev/null 2>&1 \
      || echo "setup: could not byte-compile all of $tree (some files unwritable or not compilable);" \
              "those run as they are" >&2
  fi
done
stamp="$VENV/.ingraph-setup-stamp"
newer_reqs=""
[ -f "$COMFYUI_033_PATH/requirements.txt" ] && newer_reqs="$COMFYUI_033_PATH/requirements.txt"
want="${INGRAPH_MULTI_GPU:-1} $(cat "$REPO/requirements.txt" "$REPO/requirements-multi-gpu.txt" "$REPO/requirements-dev.txt" ${comfy_reqs:+"$comfy_reqs"} ${newer_reqs:+"$newer_reqs"} \
  "$REPO/scripts/comfyui_overlay.py" "$REPO"/tools/torchaudio_standin/torchaudio/*.py | sha256sum | cut -c1-16) $TORCH_PINS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && { [ -z "$newer_reqs" ] || [ -d "$VENV/comfyui-0.33" ]; }; then
  echo "setup: environment $VENV is up to date" >&2
  exit 0
fi

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  torch_source
  # shellcheck disable=SC2086
  "${PIP[@]}" ${TORCH_INDEX_ARGS[@]+"${TORCH_INDEX_ARGS[@]}"} $TORCH_PINS  # (bash before 4.4: an empty array is unset)
fi
constraints="$VENV/.torch-constraints.txt"
"$VENV/bin/python" -m pip freeze | grep -E '^(torch|torchvision|nvidia-[a-z0-9-]+|triton)==' > "$constraints" || true

reqs=(-r "$REPO/requirements.txt" -r "$REPO/requirements-dev.txt" requests)
# the multi-GPU extra (DeepSpeed) too, for the multi-process tests; INGRAPH_MULTI_GPU=0: the plain install a
# one-GPU user has, where those tests skip with one line each
[ "${INGRAPH_MULTI_GPU:-1}" = "0" ] || reqs+=(-r "$REPO/requirements-multi-gpu.txt")
if [ -n "$comfy_reqs" ]; then
  # torchaudio is optional for ComfyUI (audio nodes only) and would pull another torch
  grep -v -E '^\s*(torch|torchvision|torchaudio)\s*($|[<>=!~;])' "$comfy_reqs" > "$VENV/.comfyui-requirements.txt"
  reqs+=(-r "$VENV/.comfyui-requirements.txt")
fi
echo "setup: installing requirements into $VENV" >&2
"${PIP[@]}" -c "$constraints" "${reqs[@]}"
if [ -n "$newer_reqs" ]; then
  # what ComfyUI 0.33 needs beyond this environment goes into an overlay its tier puts first on PYTHONPATH
  echo "setup: overlay for $COMFYUI_033_PATH in $VENV/comfyui-0.33" >&2
  "$VENV/bin/python" "$REPO/scripts/comfyui_overlay.py" "$COMFYUI_033_PATH" "$VENV/comfyui-0.33"
fi
compile_venv
echo "$want" > "$stamp"
echo "setup: done" >&2
