"""The memory plan against the memory a run really takes: for the full-architecture SD1.5 random checkpoint,
the full SDXL UNet (tools/realsize_models.py; SDXL's text embeddings from the tests' synthetic CLIP-L+G
stand-in, its latents from the SD1.5 file's VAE, which has SDXL's latent shape) and the Flux.1-dev architecture in fp8
(random latents and T5 text of Flux's shapes written to a cache as the cache nodes write them) and a set of settings,
the trainer program's predicted peak (its started event's memory_plan) and the measured one, each run a fresh trainer
process, with its seconds per step.

Settings "card_12GB" and "card_24GB" are "auto" on the budget a card of that size gives a plan (its memory less the
CUDA context's, times the plan's margin): issue 30's figures are SDXL at 1024 px on a 12 GB card and the Flux
architecture on an fp8 base on a 24 GB one (`--sdxl --sdxl-resolution 1024 --sdxl-settings card_12GB --flux`).

Measured: on a CPU, the trainer's resident memory above its baseline (VmHWM minus the resident bytes when the
model's load began, the finished event's host_memory; the plan's CPU peak is the device's, the host's being the
same memory); on a GPU, max_memory_allocated (the finished event's device_memory) against the plan's device peak.

    python bench/memory_plan.py [--work DIR] [--checkpoint realsize_sd15.safetensors] [--resolution 512]
                                [--settings lora lora_ckpt ...] [--steps 2]
                                [--sdxl [--sdxl-unet realsize_sdxl_unet.safetensors] --sdxl-settings lora ...
                                 --sdxl-resolution 1024]
                                [--flux [--flux-file realsize_flux_fp8.safetensors] [--flux-blocks 19,38]
                                 --flux-settings card_24GB ... --flux-resolution 1024]

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
CUDA_CONTEXT_GIB = 0.6  # what the CUDA context and a desktop leave of a card's memory, roughly


def card_budget_gb(card_gib: float) -> float:
    """The budget the memory plan takes on a card of `card_gib` GiB: its free memory times the plan's margin."""
    from ingraph_trainer.trainer.parallel.memory_plan import MARGIN
    return round((card_gib - CUDA_CONTEXT_GIB) * MARGIN, 2)


# name -> spec overrides (table, key, value); a callable value is computed once the pack is importable
SETTINGS = {
    "lora": [],
    "lora_ckpt": [("train", "gradient_checkpointing", True)],
    "lora_fp8": [("model", "base_precision", "fp8")],
    "lora_fp8_ckpt": [("model", "base_precision", "fp8"), ("train", "gradient_checkpointing", True)],
    "lora_swap6": [("distributed", "block_swap", 6)],
    "lora_fp32": [("train", "precision", "fp32")],
    # LoKr builds each adapted layer's whole weight change, made again in the backward pass rather than kept
    # (trainer/recomputed_delta.py). Not in the default list: on a CPU the measure is the process's resident memory,
    # and glibc's heap keeps the pages of those changes (13-26 MB each for SDXL, under its mmap threshold) once
    # activations are placed between them; the plan counts live bytes, as max_memory_allocated does on a GPU
    "lokr_all": [("adapter", "kind", "lokr"), ("adapter", "targets", "all_linear")],
    "full_ckpt": [("adapter", "kind", "full"), ("train", "gradient_checkpointing", True)],
    # "auto" on a simulated budget between SD1.5's LoRA plans with and without checkpointing (4.7 and 3.0 GiB at
    # 512 px): it must choose checkpointing, and the measured peak must fit the budget
    "lora_auto_3.5GiB": [("train", "memory", "auto"), ("train", "memory_budget_gb", 3.5)],
    "card_12GB": [("train", "memory", "auto"), ("train", "memory_budget_gb", lambda: card_budget_gb(12))],
    "card_24GB": [("train", "memory", "auto"), ("train", "memory_budget_gb", lambda: card_budget_gb(24))],
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


def prepare_flux(model_file: Path, work: Path, resolution: int, items: int = 2) -> Path:
    """A run spec of the Flux file as Load Diffusion Model hands it over with weight_dtype fp8_e4m3fn, on `items`
    random latents (16 channels, 1/8 of the resolution) and T5 texts (512 x 4096, pooled 768) cached as the cache
    nodes cache theirs (Flux's encoders are too large to build here)."""
    import torch
    from ingraph_trainer.runner.session import RunDatasets, prepare_run
    from ingraph_trainer.trainer.models import Batch
    from ingraph_trainer.trainer.spec import ModelSpec, RunSpec, TrainSpec
    from tools.coverage_runs import cache_batch
    g = torch.Generator().manual_seed(0)
    side = resolution // 8
    latents = torch.randn(items, 16, side, side, generator=g)
    batch = Batch(latents, torch.randn(items, 512, 4096, generator=g), torch.randn(items, 768, generator=g),
                  torch.randn_like(latents), torch.rand(items, generator=g))
    dataset = cache_batch(batch, work / "cache_flux", f"flux{resolution}")
    run_dir = work / "base_flux"
    shutil.rmtree(run_dir, ignore_errors=True)
    model = ModelSpec(path=str(model_file), format="diffusion_model", weight_dtype="fp8_e4m3fn")
    _, spec = prepare_run(RunSpec(model=model, train=TrainSpec(steps=1)), runs_root=work, run_dir=run_dir,
                          name="flux", datasets=RunDatasets(dataset), cache_root=work / "cache_flux",
                          lora_path=run_dir / "lora.safetensors")
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
        value = value() if callable(value) else value
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
    steps_done = [e for e in events if e["type"] == "step" and e.get("step_time_s") is not None]
    later = [e["step_time_s"] for e in steps_done[1:]] or [e["step_time_s"] for e in steps_done]
    device = finished.get("device_memory")
    measured = device["peak_allocated"] if device else finished["host_memory"]["rise"]
    predicted = plan["device_peak"] if device else plan["host_peak"]
    budget = plan["budget"] if spec.train.memory_budget_gb else None
    return {"name": name, "predicted": predicted, "measured": measured, "ratio": predicted / measured,
            "parts": plan["parts"], "seconds": time.perf_counter() - began, "budget": budget,
            "s_step": sorted(later)[len(later) // 2] if later else None,
            "chosen": f"checkpointing {'on' if started['gradient_checkpointing'] else 'off'}, "
                      f"block_swap {started['block_swap']}"}


def main(argv=None):
    from tools.realsize_models import block_counts
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ingraph-memory-plan"))
    parser.add_argument("--checkpoint", type=Path, default=None, help="the SD1.5 realsize checkpoint (else built)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--settings", nargs="*", default=[s for s in SETTINGS if s != "lokr_all"],
                        choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--sdxl", action="store_true", help="also the full SDXL UNet (5.1 GB file; about 10 GiB of RAM)")
    parser.add_argument("--sdxl-unet", type=Path, default=None, help="the SDXL realsize UNet file (else built)")
    parser.add_argument("--sdxl-settings", nargs="*", default=["lora", "lora_ckpt"], choices=list(SETTINGS))
    parser.add_argument("--sdxl-resolution", type=int, default=None, help="SDXL's image side (default --resolution)")
    parser.add_argument("--flux", action="store_true",
                        help="also the Flux.1-dev architecture in fp8 (an 11.9 GB file; --flux-blocks to shrink it)")
    parser.add_argument("--flux-file", type=Path, default=None, help="the Flux realsize file (else built)")
    parser.add_argument("--flux-blocks", type=block_counts, default=(19, 38),
                        help="double,single blocks of a built Flux file (default 19,38: the model)")
    parser.add_argument("--flux-settings", nargs="*", default=["card_24GB"], choices=list(SETTINGS))
    parser.add_argument("--flux-resolution", type=int, default=1024)
    parser.add_argument("--only", action="store_true", help="leave SD1.5 out (the --sdxl and --flux runs alone)")
    opts = parser.parse_args(argv)
    if opts.only and not (opts.sdxl or opts.flux):
        parser.error("--only leaves SD1.5 out: give --sdxl and/or --flux")
    from tools.prepare_run import _bootstrap, prepare
    from tools.realsize_models import build_flux, build_sd15, build_sdxl_unet
    _bootstrap()
    work = opts.work
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = opts.checkpoint or work / "realsize_sd15.safetensors"
    if not checkpoint.exists() and not (opts.only and not opts.sdxl):  # SDXL's latents come from its VAE
        print(f"building {checkpoint}", flush=True)
        build_sd15(checkpoint)
    # each model's rows run straight after its files are made, and the table is written after every row: a run that
    # hits its time limit while building the next model keeps what it measured
    def sd15():
        images = write_images(work / "images", 2, opts.resolution)
        base = prepare(checkpoint, images, work / "base_run", {"train.steps": 1}, resolution=opts.resolution)
        return [("SD1.5", base, name, opts.resolution) for name in opts.settings]

    def sdxl():
        unet = opts.sdxl_unet or work / "realsize_sdxl_unet.safetensors"
        if not unet.exists():
            print(f"building {unet}", flush=True)
            build_sdxl_unet(unet)
        size = opts.sdxl_resolution or opts.resolution
        spec = prepare_sdxl(unet, checkpoint, write_images(work / f"images{size}", 2, size), work, size)
        return [("SDXL", spec, name, size) for name in opts.sdxl_settings]

    def flux():
        blocks = opts.flux_blocks
        flux_file = opts.flux_file or work / f"realsize_flux_{blocks[0]}_{blocks[1]}_fp8.safetensors"
        if not flux_file.exists():
            print(f"building {flux_file}", flush=True)
            build_flux(flux_file, blocks=blocks)
        spec = prepare_flux(flux_file, work, opts.flux_resolution)
        return [("Flux", spec, name, opts.flux_resolution) for name in opts.flux_settings]

    rows = []
    for model_runs in [m for m, wanted in ((sd15, not opts.only), (sdxl, opts.sdxl), (flux, opts.flux)) if wanted]:
        for model, spec, name, size in model_runs():
            row = run_setting(spec, work, name, opts.steps, opts.timeout)
            row.update(model=model, resolution=size)
            rows.append(row)
            parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in row["parts"].items() if v)
            step = "n/a" if row["s_step"] is None else f"{row['s_step']:.3f} s/step"
            print(f"{model:6s} {size:4d} px {name:14s} predicted {row['predicted'] / GiB:6.2f} GiB  measured "
                  f"{row['measured'] / GiB:6.2f} GiB  ratio {row['ratio']:.3f}  ({parts}; {row['chosen']}; {step}; "
                  f"{row['seconds']:.0f} s)", flush=True)
            if row["budget"]:
                print(f"  on a budget of {row['budget'] / GiB:.2f} GiB: measured {row['measured'] / GiB:.2f} GiB "
                      f"{'fits' if row['measured'] <= row['budget'] else 'DOES NOT FIT'}", flush=True)
            (work / "memory_plan.json").write_text(json.dumps(rows, indent=1))
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1.0))
    print(f"worst ratio predicted/measured: {worst['ratio']:.3f} ({worst['model']} {worst['name']} at "
          f"{worst['resolution']} px)")


if __name__ == "__main__":
    main()
