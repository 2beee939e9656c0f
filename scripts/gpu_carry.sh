#!/usr/bin/env bash
# Builds, here, what a lent GPU machine (py3.12 at /opt/torch/.venv, torch 2.11, no network) needs to run this
# pack and ComfyUI 0.3.x (shared/DESIGN.md, "The GPU machine some sessions are lent"):
#   $GPU_DIR/whl/    py3.12 manylinux x86_64 wheels of what the device lacks, DeepSpeed's pure-Python wheel built
#                    here, and stub/ (a stand-in comfyui_frontend_package: ComfyUI's server exits without one)
#   $GPU_DIR/comfy/  ComfyUI.tar.xz, the source of COMFYUI_PATH without tests and .git
#   $GPU_DIR/repo/   (only with --snapshot) `git archive HEAD` of this repo, so a run sees a fixed commit
# Each folder is under 64 MiB, the most one device call carries; whl, comfy and repo together are about 57 MiB, so
# every call carries those three and begins with scripts/gpu_smoke.sh's install stage (skipped on a machine still
# warm from the call before; a machine given back comes back bare): docs/development.md, "On a lent GPU machine".
# With --with-0.33 it also builds what ComfyUI 0.33 needs there (issue 27 on a card: dynamic VRAM, quantized layouts):
#   $GPU_DIR/whl033/   0.33's extra requirements the 0.3.x set lacks (comfy-aimdo, blake3, simpleeval), at the versions
#                      its requirements.txt pins
#   $GPU_DIR/kitchen/  comfy-kitchen alone (its CUDA kernels make it ~58 MB: a call of its own)
#   $GPU_DIR/comfy033/ ComfyUI-0.33.tar.xz, the source of $COMFYUI_033_PATH (default /opt/ComfyUI-0.33)
# scripts/gpu_smoke.sh's install033 stage installs whichever of these a call carried; COMFY=0.33 runs its stages there.
# Versions are those installed in $INGRAPH_VENV (default .venv) where it has them, else the defaults below.
# Needs `.gpu/` ignored: echo /.gpu/ >> .git/info/exclude
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPU_DIR="${GPU_DIR:-$REPO/.gpu}"
VENV="${INGRAPH_VENV:-$REPO/.venv}"
COMFYUI_PATH="${COMFYUI_PATH:-/opt/ComfyUI}"
PY="${PYTHON:-python3}"

# name → default version ("" = the newest the index has). The optimizers are pinned by requirements.txt.
declare -A DEFAULT=(
  [diffusers]="" [av]="" [SQLAlchemy]="" [greenlet]="" [alembic]="" [Mako]=""
  [pydantic]="" [pydantic-settings]="" [python-dotenv]="" [annotated-types]="" [typing-inspection]=""
  [torchsde]="" [trampoline]="" [websocket-client]="" [hjson]=""
  [prodigyopt]="1.1.2" [schedulefree]="1.4.1" [pytorch-optimizer]="4.1.0"
)
DEEPSPEED_DEFAULT="0.19.8"

venv_version() {  # the version of $1 installed in $VENV, or nothing
  [ -x "$VENV/bin/python" ] || return 0
  "$VENV/bin/python" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p' || true
}
spec_of() {
  local v; v="$(venv_version "$1")"; v="${v:-${DEFAULT[$1]:-}}"
  if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi
}

WHL="$GPU_DIR/whl"
rm -rf "$WHL" "$GPU_DIR/comfy"
mkdir -p "$WHL" "$GPU_DIR/comfy"
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {  # into $WHL (a caller may set WHL for one call)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none "${PLAT[@]}" --platform any -d "$WHL" "$@"
}

specs=()
for name in "${!DEFAULT[@]}"; do specs+=("$(spec_of "$name")"); done
echo "gpu_carry: downloading ${specs[*]}" >&2
download "${specs[@]}"

# pydantic-core must be the exact version this pydantic asks for
core="$(unzip -p "$WHL"/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core *\(==[^ ;,]*\).*/\1/p' | head -1)"
echo "gpu_carry: pydantic-core$core" >&2
download "pydantic-core$core"

# DeepSpeed is an sdist only: its pure-Python wheel, built here (no ops compiled; they JIT-build where needed)
ds="$(venv_version deepspeed)"; ds="${ds:-$DEEPSPEED_DEFAULT}"
echo "gpu_carry: building deepspeed==$ds" >&2
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$WHL" "deepspeed==$ds"

# ComfyUI 0.3.x's server exits when comfyui_frontend_package is missing; the tests use its HTTP API only
mkdir -p "$WHL/stub/comfyui_frontend_package/static"
echo '__version__ = "0.0.0-stub"' > "$WHL/stub/comfyui_frontend_package/__init__.py"
echo '<!doctype html><title>ComfyUI (frontend stub)</title>' > "$WHL/stub/comfyui_frontend_package/static/index.html"

# ComfyUI's source, without its tests and history
tar -C "$COMFYUI_PATH" --exclude=./.git --exclude=./tests --exclude=./tests-unit --exclude='__pycache__' \
    --exclude='*.pyc'\
    -cJf "$GPU_DIR/comfy/ComfyUI.tar.xz" .

pinned_in_033() {  # NAME → NAME==VERSION as 0.33's requirements.txt pins it, else NAME
  local line; line="$(grep -i -E "^$1[ =<>~!]" "$COMFYUI_033/requirements.txt" | head -1 | tr -d ' ' || true)"
  case "$line" in *==*) echo "$line" ;; *) echo "$1" ;; esac
}
if [[ " $* " == *" --with-0.33 "* ]]; then
  COMFYUI_033="${COMFYUI_033_PATH:-/opt/ComfyUI-0.33}"
  [ -f "$COMFYUI_033/requirements.txt" ] || { echo "gpu_carry: no ComfyUI 0.33 at $COMFYUI_033" >&2; exit 1; }
  rm -rf "$GPU_DIR/whl033" "$GPU_DIR/kitchen" "$GPU_DIR/comfy033"
  mkdir -p "$GPU_DIR/whl033" "$GPU_DIR/kitchen" "$GPU_DIR/comfy033"
  WHL="$GPU_DIR/whl033" download "$(pinned_in_033 comfy-aimdo)" "$(pinned_in_033 blake3)" "$(pinned_in_033 simpleeval)"
  WHL="$GPU_DIR/kitchen" download "$(pinned_in_033 comfy-kitchen)"
  tar -C "$COMFYUI_033" --exclude=./.git --exclude=./tests --exclude=./tests-unit --exclude='__pycache__' \
      --exclude='*.pyc' -cJf "$GPU_DIR/comfy033/ComfyUI-0.33.tar.xz" .
fi

if [[ " $* " == *" --snapshot "* ]]; then
  rm -rf "$GPU_DIR/repo" && mkdir -p "$GPU_DIR/repo"
  git -C "$REPO" archive HEAD | tar -x -C "$GPU_DIR/repo"
  git -C "$REPO" rev-parse HEAD > "$GPU_DIR/repo/.commit"  # inside: it travels with the snapshot
fi

ls -l "$WHL" >&2
for d in "$WHL" "$GPU_DIR/comfy" "$GPU_DIR/repo" "$GPU_DIR/whl033" "$GPU_DIR/kitchen" "$GPU_DIR/comfy033"; do
  [ -d "$d" ] && echo "gpu_carry: $(du -sb "$d" | awk '{printf "%.1f MiB", $1/1048576}')  $d" >&2
done
mib() { du -sb "$1" | awk '{print int($1/1048576)+1}'; }
if [ "$(mib "$WHL")" -gt 60 ]; then
  echo "gpu_carry: WARNING $WHL is over 60 MiB; with the repo it may not fit one call" >&2
fi
