"""The GPU bench: the Train node through a real ComfyUI server on the GPU, against ComfyUI's own TrainLoraNode and a
bare PyTorch loop on the same batch shapes, on the full-architecture SD1.5 or SDXL random-weight checkpoint
(tools/realsize_models.py; SDXL's has both its text encoders, so the graph encodes its captions itself).

    python bench/gpu.py [--model sd15|sdxl] [--size 512] [--steps 20] [--batch 2] [--rank 16]
                        [--cases lora,lora_conv,fp8,lokr,stop,native,bare]
    python bench/gpu.py --model sdxl --size 1024 --batch 1 --cases lokr,bare  # beside SimpleTuner's figure below
    python bench/gpu.py --tiny --size 64 --steps 3      # the same code path on the tiny SD1.5 (a CPU check)

Each case of ours is a Train node (previews on, rendered once mid-run) in one server started without --cpu:
- lora: LoRA on all linear layers, bf16; fp8: the same on an fp8 base (base_precision fp8); lokr: LoKr, bf16;
- stop: a long run stopped from the pack's stop route after a few steps, resumed with resume=latest, stopped again
  (the resumed run's first step must be the stopped run's last + 1);
- native: ComfyUI's TrainLoraNode (LoRA on every weight), s/step differential over 1 and 1+steps steps;
- bare: in this process, the checkpoint's UNet in bf16 with peft LoRA on its linear layers, AdamW, random latents and
  text embeddings of the same shapes: the floor for a step.

What it prints per case: s/step (ours: the median of the trainer's step_time_s past step 2), peak device memory (ours:
the trainer's torch.cuda.max_memory_allocated in its finished event; bare: this process's; and for every case the
driver's figure, the GPU's memory.used peak above its idle level sampled every 0.2 s through nvidia-smi), and model
FLOPs utilisation (the UNet's forward+backward FLOPs at this batch, counted once with torch's FlopCounterMode, over
s/step and the card's dense bf16 peak; the bare loop's count stands for every case, so LoKr's and the fp8 base's
MFU are approximate). The last lines are the ratios against the bare loop and TrainLoraNode. The driver's figure reads
GPU 0 (nvidia-smi's numbering): run the bench with one visible GPU.
The published figure to beat (SimpleTuner, SDXL LoKr at 1024², H100): 0.61 s/step in 13 GiB; with --model sdxl at
1024 px the summary sets the LoKr case beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.vs_native import fit_to_schema, native_dataset_nodes, native_workflow, node_seconds  # noqa: E402
from client.api import ComfyClient  # noqa: E402
from tools.comfy_server import ComfyServer, comfyui_available, comfyui_path  # noqa: E402

CKPT = "gpu_bench.safetensors"
IMAGES = "gpu_bench_images"
SIMPLETUNER_SDXL_LOKR = (0.61, 13.0)  # s/step and GiB, SDXL LoKr at 1024 px on an H100 (SimpleTuner's published run)
# dense bf16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name()
BF16_PEAK = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
             "RTX 4090": 165e12, "RTX 5090": 209e12, "RTX 3090": 71e12, "A10G": 70e12, "A10": 125e12}


class DriverMemory:
    """The GPU's memory.used (nvidia-smi, MiB) sampled in a thread; peak() is the largest since reset() above the
    idle level read at start. None where nvidia-smi is absent (a CPU)."""

    def __init__(self, interval_s: float = 0.2):
        self.available = shutil.which("nvidia-smi") is not None
        self.interval_s, self._peak, self._stop = interval_s, 0, threading.Event()
        self.idle = self.read() if self.available else None
        if self.available:
            threading.Thread(target=self._loop, daemon=True).start()

    def read(self) -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
            return int(out[0]) if out else None
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def _loop(self):
        while not self._stop.wait(self.interval_s):
            used = self.read()
            if used is not None:
                self._peak = max(self._peak, used)

    def reset(self):
        """A case starts: its figure is the peak above the level now (what an earlier case left loaded excluded)."""
        self.idle = self.read() if self.available else None
        self._peak = self.idle or 0

    def peak_gib(self) -> float | None:
        if not self.available or self.idle is None:
            return None
        return max(self._peak - self.idle, 0) / 1024

    def stop(self):
        self._stop.set()


def gib(n) -> str:
    return "n/a" if n is None else f"{n:.2f} GiB"


def train_graph(opts, name: str, *, kind: str = "LoRA", base_precision: str = "as loaded", steps: int | None = None,
                resume: str = "off", previews: bool = True, targets: str = "all linear layers") -> dict:
    steps = steps or opts.steps
    wf = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}},
        "2": {"class_type": "InGraphLoadTrainingImages",
              "inputs": {"folder": IMAGES, "resolution": opts.size, "bucketing": False, "min_side": opts.size,
                         "max_side": opts.size, "max_upscale": 1.0, "crop": "center", "flip": False, "repeats": 1,
                         "caption_prefix": "", "missing_caption": "error", "default_caption": ""}},
        "3": {"class_type": "InGraphCacheLatents", "inputs": {"dataset": ["2", 0], "vae": ["1", 2]}},
        "4": {"class_type": "InGraphCacheTextEmbeddings", "inputs": {"dataset": ["3", 0], "clip": ["1", 1]}},
        "5": {"class_type": "InGraphLoRAAdapter",
              "inputs": {"kind": kind, "rank": opts.rank, "alpha": float(opts.rank), "dropout": 0.0,
                         "targets": targets}},
        "7": {"class_type": "InGraphTrainLoRA",
              "inputs": {"model": ["1", 0], "dataset": ["4", 0], "adapter": ["5", 0], "steps": steps,
                         "batch_size": opts.batch, "gradient_accumulation": 1, "learning_rate": 1e-4,
                         "optimizer": "AdamW", "lr_schedule": "constant", "warmup_steps": 0, "precision": "bf16",
                         "gradient_checkpointing": False, "seed": 0, "save_every": 0, "output_name": name,
                         "resume": resume, "base_precision": base_precision, "eval_quantiles": "0.5"}},
        "8": {"class_type": "PreviewImage", "inputs": {"images": ["7", 2]}},
    }
    if previews:
        wf["6"] = {"class_type": "InGraphSamplePreviews",
                   "inputs": {"clip": ["1", 1], "vae": ["1", 2], "prompts": "a red circle, ingraph style",
                              "negative_prompt": "", "every": max(steps // 2, 1), "steps": 4, "cfg": 5.0,
                              "sampler_name": "euler", "scheduler": "normal", "seed": 0, "width": opts.size,
                              "height": opts.size}}
        wf["7"]["inputs"]["previews"] = ["6", 0]
    return wf


def events_of(outcome) -> list[dict]:
    return [m["data"]["event"] for m in outcome.messages if m.get("type") == "ingraph.event"]


def ours(client, driver, opts, label: str, wf: dict) -> dict:
    driver.reset()
    outcome = client.run(wf, timeout=opts.timeout)
    if not outcome.ok:
        raise RuntimeError(f"{label}: {outcome.status}: {json.dumps(outcome.error)[:3000]}")
    events = events_of(outcome)
    steps = [e for e in events if e["type"] == "step"]
    finished = [e for e in events if e["type"] == "finished"][-1]
    started = next(e for e in events if e["type"] == "started")
    later = [e["step_time_s"] for e in steps if e.get("step", 0) > 2 and e.get("step_time_s")] or \
        [e["step_time_s"] for e in steps if e.get("step_time_s")]
    memory = finished.get("device_memory") or {}
    result = {"label": label, "s_step": statistics.median(later) if later else None,
              "peak_gib": memory["peak_allocated"] / 2**30 if memory.get("peak_allocated") else None,
              "driver_gib": driver.peak_gib(), "steps": len(steps), "device": started.get("device"),
              "precision": started.get("precision"), "samples": sum(e["type"] == "sample" for e in events),
              "loss": (steps[0]["loss"], steps[-1]["loss"]) if steps else None}
    print(f"{label}: {fmt_s(result['s_step'])}/step; peak allocated {gib(result['peak_gib'])}, driver "
          f"{gib(result['driver_gib'])}; {result['steps']} steps on {result['device']} in {result['precision']}, "
          f"{result['samples']} preview(s), loss {result['loss']}", flush=True)
    return result


def stop_and_resume(client, driver, opts) -> dict:
    """A long run stopped after a few steps, resumed with resume=latest, stopped again."""
    name = "gpu_bench_stop"
    found = {}
    for round_, resume in ((1, "off"), (2, "latest")):
        wf = train_graph(opts, name, steps=100000, resume=resume, previews=False)
        prompt_id = client.queue(wf)
        data, first = client.wait_for_step(prompt_id, (found.get("stopped_at") or 0) + 5, opts.timeout)
        if round_ == 2:
            found["resumed_first"] = first
        t0 = time.monotonic()
        assert client.post(f"/ingraph/runs/{data['run_id']}/stop")["stop_requested"] is True
        outcome = client.follow(prompt_id, timeout=opts.timeout)
        found[f"stop_s_{round_}"] = time.monotonic() - t0
        if not outcome.ok:
            raise RuntimeError(f"stop round {round_}: {outcome.status}: {json.dumps(outcome.error)[:3000]}")
        finished = [e for e in events_of(outcome) if e["type"] == "finished"][-1]
        found["stopped_at"] = finished["steps"]
        found[f"stopped_{round_}"] = finished["steps"]
    ok = found["resumed_first"] == found["stopped_1"] + 1
    print(f"stop and resume: stopped at step {found['stopped_1']} ({found['stop_s_1']:.1f} s after the request), "
          f"resumed at step {found['resumed_first']} ({'continues' if ok else 'DOES NOT continue'} the run), stopped "
          f"again at {found['stopped_2']} ({found['stop_s_2']:.1f} s)", flush=True)
    found["ok"] = ok
    return found


def native(client, driver, opts) -> dict:
    dataset_nodes = native_dataset_nodes(client)
    times = {}
    driver.reset()
    # a warm-up run first (it loads the model and encodes the images), with another seed and name: ComfyUI would
    # serve an identical prompt from its cache without running the node
    for steps, seed in ((1, 99), (1, 1), (1 + opts.steps, 1)):
        wf = fit_to_schema(client, native_workflow(steps, opts.rank, opts.batch, "bf16", seed=seed, checkpoint=CKPT,
                                                   images=IMAGES, prefix=f"gpu_native_{steps}_{seed}",
                                                   dataset_nodes=dataset_nodes))
        outcome = client.run(wf, timeout=opts.timeout, on_message=lambda m: m.__setitem__("_t", time.monotonic()))
        if not outcome.ok:
            raise RuntimeError(f"TrainLoraNode {steps} steps: {outcome.status}: {json.dumps(outcome.error)[:2000]}")
        times[steps] = node_seconds(outcome, "4")
    s_step = (times[1 + opts.steps] - times[1]) / opts.steps
    result = {"label": "ComfyUI TrainLoraNode", "s_step": s_step, "peak_gib": None, "driver_gib": driver.peak_gib()}
    print(f"ComfyUI TrainLoraNode (LoRA on every weight, bf16): {s_step:.4f} s/step (differential); driver "
          f"{gib(result['driver_gib'])}", flush=True)
    return result


def bare_loop(opts, checkpoint: Path) -> dict:
    """The UNet alone in bf16 with peft LoRA (rank opts.rank) on its linear layers, AdamW, one random batch of the
    graph's shapes, in this process; and its forward+backward FLOPs."""
    import torch
    sys.path.insert(0, str(comfyui_path()))
    if not torch.cuda.is_available():  # ComfyUI's device choice, made when model_management is first imported
        from comfy.cli_args import args
        args.cpu = True
    import comfy.sd
    from peft import LoraConfig, inject_adapter_in_model
    from torch.utils.flop_counter import FlopCounterMode
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, *_ = comfy.sd.load_checkpoint_guess_config(str(checkpoint), output_vae=False, output_clip=False)
    unet_config = model.model.model_config.unet_config
    context_dim, adm = unet_config["context_dim"], unet_config.get("adm_in_channels")  # SDXL: 2048 and 2816
    unet = model.model.diffusion_model.to(device=device, dtype=torch.bfloat16)
    unet.requires_grad_(False)
    names = [n for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear)]  # full names: "0" is ambiguous
    unet = inject_adapter_in_model(LoraConfig(r=opts.rank, lora_alpha=opts.rank, target_modules=names), unet)
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    side = opts.size // 8
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(opts.batch, 4, side, side, device=device, generator=generator)
    context = torch.randn(opts.batch, 77, context_dim, device=device, generator=generator)
    y = torch.randn(opts.batch, adm, device=device, generator=generator).to(torch.bfloat16) if adm else None
    noise = torch.randn_like(x)
    t = torch.randint(0, 1000, (opts.batch,), device=device, generator=generator)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = unet((x + noise).to(torch.bfloat16), t, context=context.to(torch.bfloat16), y=y)
        loss = torch.nn.functional.mse_loss(pred.float(), noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    flops = FlopCounterMode(display=False)
    with flops:
        step()
    total_flops = flops.get_total_flops()
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(max(opts.steps, 5)):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    result = {"label": "bare PyTorch loop", "s_step": statistics.median(times), "peak_gib": peak,
              "driver_gib": None, "flops": total_flops}
    print(f"bare PyTorch loop (UNet bf16, peft LoRA rank {opts.rank} on {len(names)} linear layers): "
          f"{result['s_step']:.4f} s/step; peak allocated {gib(peak)}; forward+backward {total_flops / 1e12:.2f} TFLOP "
          f"per step", flush=True)
    del unet, model, optimizer, params  # the checkpoint too: its memory goes back before the next case
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def fmt_s(s) -> str:
    return "n/a" if s is None else f"{s:.4f} s"


def device_name() -> tuple[str, float | None]:
    import torch
    if not torch.cuda.is_available():
        return f"CPU ({os.cpu_count()} cores)", None
    name = torch.cuda.get_device_name()
    return name, next((peak for key, peak in BF16_PEAK.items() if key in name), None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=512, help="image side (pixels)")
    parser.add_argument("--steps", type=int, default=20, help="training steps of each timed run")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--cases", default="lora,lora_conv,fp8,lokr,stop,native,bare",
                        help="lora_conv: our LoRA where TrainLoraNode puts its own (linear and convolution layers), "
                             "the like-for-like comparison with native")
    parser.add_argument("--model", default="sd15", choices=("sd15", "sdxl"),
                        help="the full-architecture checkpoint built: SD1.5 (2.1 GB) or SDXL with both text encoders "
                             "(6.9 GB)")
    parser.add_argument("--tiny", action="store_true", help="the tiny SD1.5 instead of the full architecture")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint of --model's layout to use (default: built)")
    parser.add_argument("--work", type=Path, help="the server's base directory (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=900)
    opts = parser.parse_args(argv)
    if opts.tiny and opts.model != "sd15":
        parser.error("--tiny builds the tiny SD1.5: it goes with --model sd15")
    if not comfyui_available():
        print("skipped: ComfyUI not found (set COMFYUI_PATH)")
        return
    cases = set(opts.cases.split(","))
    name, peak_flops = device_name()
    work = opts.work or Path(tempfile.mkdtemp(prefix="ingraph-gpu-bench-"))
    base = work / "comfy"
    checkpoint = opts.checkpoint or work / f"{'tiny' if opts.tiny else opts.model}_{CKPT}"
    t0 = time.monotonic()
    if not checkpoint.is_file():
        if opts.tiny:
            from tools.embedded_default import build_checkpoint
            build_checkpoint(checkpoint)
        elif opts.model == "sdxl":
            from tools.realsize_models import build_sdxl
            build_sdxl(checkpoint, values="pool")
        else:
            from tools.realsize_models import build_sd15
            build_sd15(checkpoint)
    link = base / "models" / "checkpoints" / CKPT
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(checkpoint.resolve())
    from tools.embedded_default import build_images
    build_images(base / "input" / IMAGES, count=opts.images, size=opts.size)
    model = "SDXL" if opts.model == "sdxl" else "SD1.5"
    kind = "tiny" if opts.tiny else "full-architecture"
    print(f"setup: {name}; {kind} {model} ({checkpoint.stat().st_size / 2**30:.2f} "
          f"GiB, built in {time.monotonic() - t0:.0f} s), {opts.images} images {opts.size}², batch {opts.batch}, "
          f"rank {opts.rank}, {opts.steps} steps, ComfyUI at {comfyui_path()}", flush=True)
    results = {}
    if "bare" in cases:  # first, alone on the card
        results["bare"] = bare_loop(opts, checkpoint)
    driver = DriverMemory()
    # no standby trainers: each holds a CUDA context that the driver figures would count
    server = ComfyServer(base, cpu=peak_flops is None and name.startswith("CPU"), extra_env={"INGRAPH_STANDBY": "0"})
    server.start()
    try:
        server.wait_ready(300)
        client = ComfyClient(server.address)
        if "lora" in cases:
            results["lora"] = ours(client, driver, opts, "ours LoRA bf16", train_graph(opts, "gpu_bench_lora"))
        if "lora_conv" in cases:  # TrainLoraNode's placement: a LoRA on every linear and convolution layer
            results["lora_conv"] = ours(client, driver, opts, "ours LoRA bf16, linear and convolution layers",
                                        train_graph(opts, "gpu_bench_lora_conv",
                                                    targets="all linear and convolution layers"))
        if "fp8" in cases:
            results["fp8"] = ours(client, driver, opts, "ours LoRA on an fp8 base",
                                  train_graph(opts, "gpu_bench_fp8", base_precision="fp8"))
        if "lokr" in cases:
            results["lokr"] = ours(client, driver, opts, "ours LoKr bf16", train_graph(opts, "gpu_bench_lokr",
                                                                                    kind="LoKr"))
        if "stop" in cases:
            results["stop"] = stop_and_resume(client, driver, opts)
        if "native" in cases:
            results["native"] = native(client, driver, opts)
        client.close()
    except BaseException:
        print(f"ComfyUI log tail ({server.log_path}):\n{server.log_tail(60)}", file=sys.stderr)
        raise
    finally:
        server.stop()
        driver.stop()
    flops = results.get("bare", {}).get("flops")
    print("summary:")
    for key, r in results.items():
        if key == "stop":
            continue
        mfu = f"{flops / r['s_step'] / peak_flops * 100:.1f} %" if flops and peak_flops and r.get("s_step") else "n/a"
        print(f"  {r['label']}: {fmt_s(r['s_step'])}/step, peak allocated {gib(r.get('peak_gib'))}, driver "
              f"{gib(r.get('driver_gib'))}, MFU {mfu}")
    ratios = []
    for key in ("lora", "lora_conv", "fp8", "lokr"):
        for ref in ("bare", "native"):
            if key in results and ref in results and results[key]["s_step"] and results[ref]["s_step"]:
                ratios.append(f"{key}/{ref} s/step {results[key]['s_step'] / results[ref]['s_step']:.3f}")
    if "stop" in results:
        ratios.append(f"resume continues: {results['stop']['ok']}")
    lokr = results.get("lokr")
    if opts.model == "sdxl" and opts.size == 1024 and lokr and lokr["s_step"]:
        seconds, gigabytes = SIMPLETUNER_SDXL_LOKR
        ratios.append(f"lokr/SimpleTuner (SDXL LoKr at 1024 px on an H100, its published run; ours at batch "
                      f"{opts.batch}) s/step {lokr['s_step'] / seconds:.3f}, memory {gib(lokr.get('peak_gib'))} "
                      f"allocated (the driver's: {gib(lokr.get('driver_gib'))}) against its {gigabytes:.0f} GiB")
    print("ratios: " + ("; ".join(ratios) or "n/a"))
    if not opts.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
