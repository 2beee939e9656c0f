#!/usr/bin/env bash
# Runs ON a lent GPU machine, from the repo root, with `.gpu` carried (scripts/gpu_carry.sh --snapshot builds it):
#   bash scripts/gpu_smoke.sh install env e2e fp8 "tests:tests/unit/test_unit.py tests/trainer/test_fp8.py"
# Stages, in the order given (each logs to $OUT/<stage>.log; OUT defaults to /tmp/gpu-out):
#   install  the carried wheels into /tmp/site (+ the frontend stub), ComfyUI's source into /tmp/ComfyUI;
#            skipped where an earlier call on this still-warm machine did it
#   install033  ComfyUI 0.33's extras (scripts/gpu_carry.sh --with-0.33), whichever this call carried: .gpu/whl033 and
#            .gpu/kitchen into /tmp/site033, .gpu/comfy033 into /tmp/ComfyUI-0.33. COMFY=0.33 then runs every other
#            stage against 0.33 (its extras first on PYTHONPATH), e.g. COMFY=0.33 bash scripts/gpu_smoke.sh env
#            "tests:tests/trainer/test_gpu.py tests/trainer/test_quantized_bases.py" (no -m gpu: it would deselect
#            the quantized bases' tests, which are not marked)
#   env      versions, the GPU, and whether ComfyUI, DeepSpeed and diffusers import
#   e2e      the trainer program end to end on the embedded default (tiny SD1.5), 64 px and 512 px, on the GPU
#   fp8      a tiny SD1.5 UNet as UNETLoader fp8_e4m3fn and fp8_e4m3fn_fast: LoRA training, then the evaluate task
#   bench    bench/gpu.py $BENCH_ARGS (the Train node vs TrainLoraNode vs a bare loop, through a ComfyUI server on the GPU)
#   memory   bench/block_swap.py (copy ahead vs blocking copies), bench/memory_plan.py (predicted vs peak) and
#            bench/adapter_memory.py (LoKr's weight change kept vs made again) on the GPU
#   fit      issue 30's figures: "auto" on the budget of a 12 GB card for SDXL at 1024 px, of a 24 GB card for the
#            Flux.1-dev architecture on an fp8 base (bench/memory_plan.py; builds a 5 GB and a 12 GB random file)
#   sdxl     issue 29's figure: bench/gpu.py --model sdxl at 1024 px, LoKr and the bare loop (beside SimpleTuner's)
#            fit and sdxl each take minutes (fit writes about 19 GB of random files): set SDXL_TIMEOUT and FIT_TIMEOUT
#            to fit the call (docs/development.md), or shrink Flux (FLUX_BLOCKS=4,8) where time is short
#   tests:F  pytest on the files F (the GPU tier: "tests:-m gpu tests/trainer/test_gpu.py"); F is split on spaces, so a -k
#            expression of several words goes in PYTEST_K (INGRAPH_SKIP_DISTILL_QUALITY=1 INGRAPH_SKIP_CHROMA_GRAPH=1), junit XML to $OUT
# Code runs from .gpu/repo (a fixed `git archive HEAD`), never from the live tree.
# Every stage but install and install033 needs install's work on this machine (a machine given back is bare): it
# stops the script with exit 3 and one line where that is missing.
set -uo pipefail
ROOT="$(pwd)"
G="$ROOT/${GPU_DIR:-.gpu}"
REPO="$G/repo"
OUTD="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site COMFYUI_PATH=/tmp/ComfyUI
if [ "${COMFY:-}" = "0.33" ]; then export PYTHONPATH=/tmp/site033:/tmp/site COMFYUI_PATH=/tmp/ComfyUI-0.33; fi
export INGRAPH_SKIP_DISTILL_QUALITY=1 INGRAPH_SKIP_CHROMA_GRAPH=1
export INGRAPH_TEST_ARTIFACTS=/tmp/test-artifacts
PY="${PY:-python3}"
W=/tmp/gpu-work
mkdir -p "$W"
SD15="$W/realsize_sd15.safetensors"  # the full-size SD1.5 random checkpoint, built once by whichever stage needs it
T0=$(date +%s)
stamp() { echo "[gpu_smoke +$(( $(date +%s) - T0 ))s] $*"; }

# the trainer program with torch.cuda's peak memory printed at its end (it leaves through os._exit)
cat > "$W/trainer_mem.py" <<'EOF'
import json, os, runpy, sys
trainer = os.path.join(sys.argv.pop(1), "trainer")
sys.argv[0] = trainer
_done = []
def report():
    if _done:
        return
    _done.append(1)
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            print("CUDA_MEM " + json.dumps({"device": torch.cuda.get_device_name(),
                  "max_allocated_MiB": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                  "max_reserved_MiB": round(torch.cuda.max_memory_reserved() / 2**20, 1)}), file=sys.stderr, flush=True)
        else:
            print("CUDA_MEM cuda never initialised in this process", file=sys.stderr, flush=True)
    except Exception as exc:
        print(f"CUDA_MEM report failed: {exc!r}", file=sys.stderr, flush=True)
_exit = os._exit
def exit_reporting(code):
    report()
    _exit(code)
os._exit = exit_reporting
import atexit
atexit.register(report)
runpy.run_path(trainer, run_name="__main__")
EOF

# events.jsonl → one summary line
cat > "$W/summary.py" <<'EOF'
import json, statistics, sys
for run in sys.argv[1:]:
    ev = [json.loads(l) for l in open(f"{run}/events.jsonl") if l.strip()]
    by = lambda t: [e for e in ev if e.get("type") == t]
    steps, started, fin, err = by("step"), by("started"), by("finished"), by("error")
    times = [e.get("step_time_s") for e in steps if e.get("step_time_s") is not None]
    out = {"run": run, "steps": len(steps)}
    if started:
        s = started[0]
        out.update({k: s.get(k) for k in ("family", "world_size", "adapted_modules", "trainable_params",
                                          "base_weight_bytes", "load_memory", "task") if k in s})
    if steps:
        out.update(loss_first=steps[0].get("loss"), loss_last=steps[-1].get("loss"),
                   samples_per_s_last=steps[-1].get("samples_per_s"))
    if len(times) > 3:
        out.update(step_s_median_after_2=round(statistics.median(times[2:]), 4), step_s_first=round(times[0], 3))
    out["evals"] = [{k: e.get(k) for k in ("step", "loss")} for e in by("eval")]
    if fin:
        f = fin[0]
        out.update({k: f.get(k) for k in ("mean_step_s", "wall_s", "adapter", "data_wait_s") if k in f})
        if f.get("evaluation"):
            out["evaluation"] = f["evaluation"]
    if err:
        out["error"] = err[0]
    print("SUMMARY " + json.dumps(out))
EOF

installed() { [ -f /tmp/site/.ingraph-installed ] && [ -f /tmp/ComfyUI/main.py ]; }  # install's work is here

stage_install() {
  if installed; then
    stamp "install: already done; repo snapshot $(cat "$REPO/.commit" 2>/dev/null)"; return 0
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl \
    || return 1
  cp -r "$G/whl/stub/." /tmp/site/
  rm -rf /tmp/ComfyUI && mkdir -p /tmp/ComfyUI && tar -xJf "$G/comfy/ComfyUI.tar.xz" -C /tmp/ComfyUI || return 1
  touch /tmp/site/.ingraph-installed
  stamp "install: done; repo snapshot $(cat "$REPO/.commit" 2>/dev/null)"
}

stage_install033() {
  local any=0 d
  for d in whl033 kitchen; do
    if ls "$G/$d"/*.whl >/dev/null 2>&1; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site033 \
        "$G/$d"/*.whl || return 1
      any=1; stamp "install033: $d installed"
    fi
  done
  if [ -f "$G/comfy033/ComfyUI-0.33.tar.xz" ]; then
    rm -rf /tmp/ComfyUI-0.33 && mkdir -p /tmp/ComfyUI-0.33 \
      && tar -xJf "$G/comfy033/ComfyUI-0.33.tar.xz" -C /tmp/ComfyUI-0.33 || return 1
    any=1; stamp "install033: ComfyUI 0.33 source extracted"
  fi
  [ "$any" = 1 ] || stamp "install033: nothing of 0.33 was carried in this call"
}

stage_env() {
  nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2
  $PY - <<'EOF'
import importlib, os, sys
print(sys.version)
for name in ("torch", "torchvision", "torchaudio", "transformers", "huggingface_hub", "safetensors", "peft",
             "accelerate", "diffusers", "deepspeed", "av", "sqlalchemy", "alembic", "pydantic", "pytest",
             "pytest_timeout", "bitsandbytes", "lycoris", "playwright", "comfy_aimdo", "comfy_kitchen"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as exc:
        print(f"{name} IMPORT FAILED: {type(exc).__name__}: {str(exc)[:200]}")
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name(0),
      torch.cuda.get_device_capability(0))
sys.path.insert(0, os.environ["COMFYUI_PATH"])
import comfy.model_management as mm
print("comfy device", mm.get_torch_device(), "supports_fp8_compute", mm.supports_fp8_compute(mm.get_torch_device()))
import deepspeed.ops  # noqa
print("deepspeed.ops imported")
EOF
}

run_trainer() {  # SPEC LABEL
  local spec="$1" label="$2"
  stamp "trainer $label: $spec"
  (cd "$(dirname "$spec")" && timeout -k 5 240 $PY "$W/trainer_mem.py" "$REPO" --config "$spec")
  local rc=$?
  stamp "trainer $label: exit $rc"
  $PY "$W/summary.py" "$(dirname "$spec")" || true
  return $rc
}

prepare() {  # CKPT IMAGES RUN_DIR [prepare_run args...] → prints the spec path
  local ckpt="$1" images="$2" run="$3"; shift 3
  timeout -k 5 180 $PY "$REPO/tools/prepare_run.py" --checkpoint "$ckpt" --images "$images" --run-dir "$run" "$@" \
    | tail -1
}

stage_e2e() {
  local d="$W/e2e"
  mkdir -p "$d"
  stamp "e2e: embedded default (64 px) and a 512 px image set"
  $PY "$REPO/tools/embedded_default.py" --checkpoint "$d/tiny.safetensors" --images "$d/img64" || return 1
  $PY "$REPO/tools/embedded_default.py" --images "$d/img512" --size 512 || return 1
  local spec
  spec=$(prepare "$d/tiny.safetensors" "$d/img64" "$d/run64" --set train.steps=60 --set train.batch_size=2 \
         --set 'train.precision="bf16"') || return 1
  run_trainer "$spec" "64px bf16 bs2 60 steps"
  spec=$(prepare "$d/tiny.safetensors" "$d/img512" "$d/run512" --resolution 512 --set train.steps=40 \
         --set train.batch_size=4 --set 'train.precision="bf16"' --set train.gradient_checkpointing=true) || return 1
  run_trainer "$spec" "512px bf16 bs4 40 steps grad-ckpt"
}

stage_fp8() {
  local d="$W/fp8"
  mkdir -p "$d"
  [ -f "$W/e2e/tiny.safetensors" ] || $PY "$REPO/tools/embedded_default.py" --checkpoint "$W/e2e/tiny.safetensors" \
    --images "$W/e2e/img64" || return 1
  # the checkpoint's diffusion model as a bf16 file of its own, as tests/trainer/test_fp8.py builds it
  $PY - "$W/e2e/tiny.safetensors" "$d/tiny_unet.safetensors" <<'EOF'
import sys, torch
from safetensors.torch import load_file, save_file
p = "model.diffusion_model."
save_file({k[len(p):]: v.to(torch.bfloat16) if v.is_floating_point() else v
           for k, v in load_file(sys.argv[1]).items() if k.startswith(p)}, sys.argv[2])
EOF
  # which ComfyUI ops the trainer's loader picks, and one LoRA forward/backward on them
  $PY - "$REPO" "$d/tiny_unet.safetensors" <<'EOF' 2>&1 | tail -40
import sys, traceback
sys.path.insert(0, sys.argv[1])
from tools.prepare_run import _bootstrap
_bootstrap()
import torch
import comfy.model_management as mm
from ingraph_trainer.trainer.spec import ModelSpec
from ingraph_trainer.trainer.models import load_family
from ingraph_trainer.trainer.adapters import inject_adapter
print("supports_fp8_compute", mm.supports_fp8_compute(mm.get_torch_device()))
for wd in ("fp8_e4m3fn", "fp8_e4m3fn_fast"):
    fam = load_family(ModelSpec(path=sys.argv[2], weight_dtype=wd), precision="bf16")
    lin = [m for m in fam.diffusion_model.modules() if isinstance(m, torch.nn.Linear)]
    print(wd, "Linear ops class:", {f"{type(m).__module__}.{type(m).__qualname__}" for m in lin},
          "weight dtypes:", {str(m.weight.dtype) for m in lin})
    attn = next(m for n, m in fam.diffusion_model.named_modules() if n.endswith("attn1.to_q"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    attn = attn.to(dev)
    x = torch.randn(2, 64, attn.in_features, device=dev, dtype=torch.bfloat16, requires_grad=True)
    try:
        y = attn(x)
        y.float().square().mean().backward()
        print(wd, "plain to_q forward/backward with grad input: OK", y.dtype)
    except Exception as exc:
        print(wd, "plain to_q forward/backward FAILED:", f"{type(exc).__name__}: {exc}")
        traceback.print_exc(limit=-3)
EOF
  local wd spec lora strengths
  for wd in fp8_e4m3fn fp8_e4m3fn_fast; do
    spec=$(prepare "$W/e2e/tiny.safetensors" "$W/e2e/img64" "$d/train_$wd" --set train.steps=10 \
           --set train.batch_size=2 --set 'train.precision="bf16"' --set adapter.rank=4 --set adapter.alpha=4.0 \
           --set "model.path=\"$d/tiny_unet.safetensors\"" --set 'model.format="diffusion_model"' \
           --set "model.weight_dtype=\"$wd\"" --set 'model.lora_paths=[]' --set 'model.lora_strengths=[]' \
           --set 'model.stamps=[]') || { stamp "fp8 $wd: prepare failed"; continue; }
    run_trainer "$spec" "fp8 train $wd"
    lora="$d/train_$wd/lora.safetensors"
    local loras tag
    for loras in '[]' "[\"$lora\"]"; do
    if [ "$loras" = '[]' ]; then strengths='[]'; tag=base; else strengths='[1.0]'; tag=lora; fi
    [ "$tag" = lora ] && [ ! -f "$lora" ] && { stamp "fp8 $wd: no LoRA written"; continue; }
    spec=$(prepare "$W/e2e/tiny.safetensors" "$W/e2e/img64" "$d/eval_${wd}_$tag" --set 'task="evaluate"' \
           --set 'output.lora_path=""' --set train.batch_size=2 --set 'train.precision="bf16"' \
           --set "model.path=\"$d/tiny_unet.safetensors\"" --set 'model.format="diffusion_model"' \
           --set "model.weight_dtype=\"$wd\"" --set "model.lora_paths=$loras" --set "model.lora_strengths=$strengths" \
           --set 'model.stamps=[]') || { stamp "fp8 $wd: evaluate prepare failed"; continue; }
    run_trainer "$spec" "fp8 evaluate $wd ($tag)"
    done
  done
}

stage_bench() {
  stamp "bench/gpu.py ${BENCH_ARGS:-}"
  # shellcheck disable=SC2086
  (cd "$REPO" && timeout -k 10 "${BENCH_TIMEOUT:-420}" $PY bench/gpu.py --work "$W/bench" ${BENCH_ARGS:-})
  stamp "bench exit $?"
}

stage_memory() {  # issue 30 on a card: block swap's copy ahead against blocking copies; the plan against the peak
  stamp "bench/block_swap.py and bench/memory_plan.py"
  (cd "$REPO" && timeout -k 10 "${MEMORY_TIMEOUT:-170}" $PY bench/block_swap.py --swap 8 --steps 6 --resolution 1024)
  local swap=$?
  (cd "$REPO" && timeout -k 10 "${MEMORY_TIMEOUT:-170}" $PY bench/memory_plan.py --work "$W/memory_plan" \
      --checkpoint "$SD15" --settings lora lora_ckpt lora_fp8 lora_swap6 lokr_all --steps 2)
  local plan=$?
  cp "$W/memory_plan/memory_plan.json" "$OUTD/memory_plan.json" 2>/dev/null  # $W does not come back; $OUT does
  (cd "$REPO" && timeout -k 10 "${MEMORY_TIMEOUT:-170}" $PY bench/adapter_memory.py \
      --checkpoint "$SD15" --targets all_layers --resolution 1024)
  stamp "memory exit: block_swap.py $swap, memory_plan.py $plan, adapter_memory.py $?"
}

stage_fit() {
  stamp "bench/memory_plan.py: SDXL 1024 px in a 12 GB card's budget, Flux fp8 in a 24 GB one"
  # (each model's figure is printed as soon as it is measured: SDXL's stands where Flux's runs out of time)
  (cd "$REPO" && timeout -k 10 "${FIT_TIMEOUT:-480}" $PY bench/memory_plan.py --work "$W/fit" --checkpoint "$SD15" \
      --only --sdxl \
      --sdxl-resolution 1024 --sdxl-settings card_12GB --flux --flux-blocks "${FLUX_BLOCKS:-19,38}" \
      --flux-settings card_24GB --steps 4)
  local fit=$?
  cp "$W/fit/memory_plan.json" "$OUTD/fit_memory_plan.json" 2>/dev/null  # whatever rows were measured
  stamp "fit exit $fit"
}

stage_sdxl() {
  stamp "bench/gpu.py --model sdxl --size 1024"
  (cd "$REPO" && timeout -k 10 "${SDXL_TIMEOUT:-420}" $PY bench/gpu.py --work "$W/sdxl" --model sdxl --size 1024 \
      --batch 1 --images 4 --steps 8 --cases "${SDXL_CASES:-lokr,bare}")
  stamp "sdxl exit $?"
}

stage_tests() {  # FILES...
  local n; n=$(ls "$OUTD"/junit*.xml 2>/dev/null | wc -l)
  stamp "pytest $*"
  (cd "$REPO" && timeout -k 10 "${TESTS_TIMEOUT:-420}" $PY -m pytest -v -rfE -p no:cacheprovider --timeout 300 \
     --junitxml="$OUTD/junit$n.xml" ${PYTEST_K:+-k "$PYTEST_K"} "$@")
  stamp "pytest exit $?"
}

# every stage but the installs runs on what they left: a machine given back between calls comes back bare
needs_install() {
  installed && [ -d "$REPO/trainer" ] || {
    echo "gpu_smoke: $1 needs the install stage first on this machine (a fresh one is bare): carry .gpu/whl" \
         ".gpu/comfy .gpu/repo and put install before it" >&2; return 1; }
  if [ "${COMFY:-}" = "0.33" ] && { [ ! -d /tmp/site033/comfy_kitchen ] || [ ! -f /tmp/ComfyUI-0.33/main.py ]; }; then
    echo "gpu_smoke: COMFY=0.33 $1 needs install033 from .gpu/kitchen and from .gpu/whl033 .gpu/comfy033 on this" \
         "machine first (ComfyUI 0.33 imports comfy_kitchen unconditionally)" >&2; return 1
  fi
}
for stage in "$@"; do  # every name checked before any stage runs: a typo at the end costs no minutes first
  case "$stage" in
    install|install033|tests:*|env|e2e|fp8|bench|memory|fit|sdxl) ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
for stage in "$@"; do
  case "$stage" in
    install|install033) ;;
    *) needs_install "$stage" || exit 3 ;;
  esac
  case "$stage" in
    tests:*) read -ra files <<< "${stage#tests:}"; stage_tests "${files[@]}" 2>&1 | tee -a "$OUTD/tests.log" ;;
    install|install033|env|e2e|fp8|bench|memory|fit|sdxl) "stage_$stage" 2>&1 | tee -a "$OUTD/$stage.log"
      [ "$stage" = install ] && ! installed && { stamp "install failed"; exit 1; } ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
stamp "all stages done"
