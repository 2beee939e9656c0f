"""The memory plan against the memory a run really takes: for the full-architecture SD1.5 random checkpoint
(tools/realsize_models.py) and a set of settings, the trainer program's predicted peak (its started event's
memory_plan) and the measured one, each run a fresh trainer process.

Measured: on a CPU, the trainer's resident memory above its baseline (VmHWM minus the resident bytes when the
model's load began, the finished event's host_memory; the plan's CPU peak is the device's, the host's being the
same memory); on a GPU, max_memory_allocated (the finished event's device_memory) against the plan's device peak.

    python bench/memory_plan.py [--work DIR] [--checkpoint realsize_sd15.safetensors] [--resolution 512]
                                [--settings lora lora_ckpt ...] [--steps 2]

The last line is the worst ratio, predicted over measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GiB = 2 ** 30
# name -> spec overrides (table, key, value)
SETTINGS = {
    "lora": [],
    "lora_ckpt": [("train", "gradient_checkpointing", True)],
    "lora_fp8": [("model", "base_precision", "fp8")],
    "lora_fp8_ckpt": [("model", "base_precision", "fp8"), ("train", "gradient_checkpointing", True)],
    "lora_swap6": [("distributed", "block_swap", 6)],
    "lora_fp32": [("train", "precision", "fp32")],
    "full_ckpt": [("adapter", "kind", "full"), ("train", "gradient_checkpointing", True)],
}


def write_images(folder: Path, count: int, size: int) -> Path:
    import numpy as np
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"a photo number {i}")
    return folder


def run_setting(base_spec: Path, work: Path, name: str, steps: int, timeout: float) -> dict:
    from ingraph_trainer.trainer.config import dump_run_spec, load_run_spec
    from ingraph_trainer.trainer.events import read_events
    spec = load_run_spec(base_spec)
    run_dir = work / f"run_{name}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a finished run is never trained again unasked
    spec.run_dir = str(run_dir)
    spec.output = dataclasses.replace(spec.output, lora_path=str(run_dir / "out.safetensors"))
    spec.train = dataclasses.replace(spec.train, steps=steps, eval_items=0, save_every=0, memory="manual")
    for table, key, value in SETTINGS[name]:
        setattr(spec, table, dataclasses.replace(getattr(spec, table), **{key: value}))
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "spec.toml"
    path.write_text(dump_run_spec(spec))
    began = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "trainer"), "--config", str(path)], capture_output=True,
                          text=True, timeout=timeout, cwd=run_dir)
    events = read_events(run_dir / "events.jsonl")
    started = next((e for e in events if e["type"] == "started"), None)
    finished = next((e for e in events if e["type"] == "finished"), None)
    if done.returncode != 0 or started is None or finished is None:
        raise SystemExit(f"{name}: the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    plan = started["memory_plan"]
    device = finished.get("device_memory")
    measured = device["peak_allocated"] if device else finished["host_memory"]["rise"]
    predicted = plan["device_peak"] if device else plan["host_peak"]
    return {"name": name, "predicted": predicted, "measured": measured, "ratio": predicted / measured,
            "parts": plan["parts"], "seconds": time.perf_counter() - began}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ingraph-memory-plan"))
    parser.add_argument("--checkpoint", type=Path, default=None, help="the SD1.5 realsize checkpoint (else built)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    opts = parser.parse_args(argv)
    from tools.prepare_run import _bootstrap, prepare
    from tools.realsize_models import build_sd15
    _bootstrap()
    work = opts.work
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = opts.checkpoint or work / "realsize_sd15.safetensors"
    if not checkpoint.exists():
        print(f"building {checkpoint}", flush=True)
        build_sd15(checkpoint)
    images = write_images(work / "images", 2, opts.resolution)
    base = prepare(checkpoint, images, work / "base_run", {"train.steps": 1}, resolution=opts.resolution)
    rows = []
    for name in opts.settings:
        row = run_setting(base, work, name, opts.steps, opts.timeout)
        rows.append(row)
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in row["parts"].items() if v)
        print(f"{name:14s} predicted {row['predicted'] / GiB:6.2f} GiB  measured {row['measured'] / GiB:6.2f} GiB  "
              f"ratio {row['ratio']:.3f}  ({parts}; {row['seconds']:.0f} s)", flush=True)
    (work / "memory_plan.json").write_text(json.dumps(rows, indent=1))
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1.0))
    print(f"worst ratio predicted/measured: {worst['ratio']:.3f} ({worst['name']}, SD1.5 at {opts.resolution}px)")


if __name__ == "__main__":
    main()
