"""The memory plan against the memory a run really takes: for the full-architecture SD1.5 random checkpoint and
the full SDXL UNet (tools/realsize_models.py; SDXL's text embeddings from the tests' synthetic CLIP-L+G
stand-in, its latents from the SD1.5 file's VAE, which has SDXL's latent shape) and a set of settings, the trainer program's predicted peak (its started event's
memory_plan) and the measured one, each run a fresh trainer process.

Measured: on a CPU, the trainer's resident memory above its baseline (VmHWM minus the resident bytes when the
model's load began, the finished event's host_memory; the plan's CPU peak is the device's, the host's being the
same memory); on a GPU, max_memory_allocated (the finished event's device_memory) against the plan's device peak.

    python bench/memory_plan.py [--work DIR] [--checkpoint realsize_sd15.safetensors] [--resolution 512]
                                [--settings lora lora_ckpt ...] [--steps 2]
                                [--sdxl [--sdxl-unet realsize_sdxl_unet.safetensors] --sdxl-settings lora ...]

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
    # "auto" on a simulated budget between SD1.5's LoRA plans with and without checkpointing (4.7 and 3.0 GiB at
    # 512 px): it must choose checkpointing, and the measured peak must fit the budget
    "lora_auto_3.5GiB": [("train", "memory", "auto"), ("train", "memory_budget_gb", 3.5)],
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


def prepare_sdxl(unet: Path, checkpoint: Path, images: Path, work: Path, resolution: int) -> Path:
    """A run spec of the SDXL UNet file: the images cached with the SD1.5 file's VAE and the synthetic SDXL text
    encoder (77 x 2048 embeddings, 1280-wide pooled vectors, as CLIP-L + CLIP-G give)."""
    import comfy.sd
    sys.path.insert(0, str(REPO / "tests" / "comfy_nodes"))
    from ingraph_test_nodes import SyntheticClip
    from ingraph_trainer.runner.session import RunDatasets, prepare_run
    from ingraph_trainer.trainer.spec import ModelSpec, RunSpec, TrainSpec
    from tools.cache_dataset import encode_folder
    vae = comfy.sd.load_checkpoint_guess_config(str(checkpoint), output_clip=False)[2]
    dataset, _ = encode_folder(images, work / "cache_sdxl", SyntheticClip("sdxl"), vae, resolution)
    run_dir = work / "base_sdxl"
    shutil.rmtree(run_dir, ignore_errors=True)
    draft = RunSpec(model=ModelSpec(path=str(unet), format="diffusion_model"), train=TrainSpec(steps=1))
    _, spec = prepare_run(draft, runs_root=work, run_dir=run_dir, name="sdxl", datasets=RunDatasets(dataset),
                          cache_root=work / "cache_sdxl", lora_path=run_dir / "lora.safetensors")
    return spec


def run_setting(base_spec: Path, work: Path, name: str, steps: int, timeout: float) -> dict:
    from ingraph_trainer.trainer.spec import dump_run_spec, load_run_spec
    from ingraph_trainer.trainer.run.events import read_events
    spec = load_run_spec(base_spec)
    run_dir = work / f"run_{base_spec.parent.name}_{name}"
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
    budget = plan["budget"] if spec.train.memory_budget_gb else None
    return {"name": name, "predicted": predicted, "measured": measured, "ratio": predicted / measured,
            "parts": plan["parts"], "seconds": time.perf_counter() - began, "budget": budget,
            "chosen": f"checkpointing {'on' if started['gradient_checkpointing'] else 'off'}, "
                      f"block_swap {started['block_swap']}"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ingraph-memory-plan"))
    parser.add_argument("--checkpoint", type=Path, default=None, help="the SD1.5 realsize checkpoint (else built)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--sdxl", action="store_true", help="also the full SDXL UNet (5.1 GB file; about 10 GiB of RAM)")
    parser.add_argument("--sdxl-unet", type=Path, default=None, help="the SDXL realsize UNet file (else built)")
    parser.add_argument("--sdxl-settings", nargs="*", default=["lora", "lora_ckpt"], choices=list(SETTINGS))
    opts = parser.parse_args(argv)
    from tools.prepare_run import _bootstrap, prepare
    from tools.realsize_models import build_sd15, build_sdxl_unet
    _bootstrap()
    work = opts.work
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = opts.checkpoint or work / "realsize_sd15.safetensors"
    if not checkpoint.exists():
        print(f"building {checkpoint}", flush=True)
        build_sd15(checkpoint)
    images = write_images(work / "images", 2, opts.resolution)
    base = prepare(checkpoint, images, work / "base_run", {"train.steps": 1}, resolution=opts.resolution)
    runs = [("SD1.5", base, name) for name in opts.settings]
    if opts.sdxl:
        unet = opts.sdxl_unet or work / "realsize_sdxl_unet.safetensors"
        if not unet.exists():
            print(f"building {unet}", flush=True)
            build_sdxl_unet(unet)
        sdxl = prepare_sdxl(unet, checkpoint, images, work, opts.resolution)
        runs += [("SDXL", sdxl, name) for name in opts.sdxl_settings]
    rows = []
    for model, spec, name in runs:
        row = run_setting(spec, work, name, opts.steps, opts.timeout)
        row["model"] = model
        rows.append(row)
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in row["parts"].items() if v)
        print(f"{model:6s} {name:14s} predicted {row['predicted'] / GiB:6.2f} GiB  measured {row['measured'] / GiB:6.2f} GiB  "
              f"ratio {row['ratio']:.3f}  ({parts}; {row['chosen']}; {row['seconds']:.0f} s)", flush=True)
        if row["budget"]:
            print(f"  on a budget of {row['budget'] / GiB:.2f} GiB: measured {row['measured'] / GiB:.2f} GiB "
                  f"{'fits' if row['measured'] <= row['budget'] else 'DOES NOT FIT'}", flush=True)
    (work / "memory_plan.json").write_text(json.dumps(rows, indent=1))
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1.0))
    print(f"worst ratio predicted/measured: {worst['ratio']:.3f} ({worst['model']} {worst['name']} at "
          f"{opts.resolution} px)")


if __name__ == "__main__":
    main()
