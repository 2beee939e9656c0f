"""LoHa's and LoKr's weight change kept from the forward pass (peft's path) against made again in the backward pass
(the trainer's, trainer/recomputed_delta.py): the peak memory of one forward and backward pass above the weights, and
the seconds each pass takes, on the full-size SD1.5 random checkpoint (tools/realsize_models.py --sd15).

    python bench/adapter_memory.py [--checkpoint realsize_sd15.safetensors] [--kind lokr] [--targets all_linear]
                                   [--resolution 256]

Each measurement runs in a fresh process. On a CPU glibc's heap would keep the pages of freed changes (13-26 MB
each, under its mmap threshold) once activations sit between them, so every allocation over 64 KB is mapped on
its own here and returned when freed: the peak resident memory (VmHWM, reset after the model is built) is then the
live bytes, as max_memory_allocated is on a GPU (used there instead, after one untimed pass). The last line is the
ratio of the peaks, recomputed over kept.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def measure(checkpoint: str, kind: str, targets: str, resolution: int, recompute: bool) -> dict:
    """In this process (a fresh one): one forward and backward pass of the adapted UNet; its figures."""
    import torch
    if not torch.cuda.is_available():
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: every allocation over 64 KB mapped on its own
        libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.models import Batch, load_family
    from ingraph_trainer.trainer.spec import ModelSpec
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    family = load_family(ModelSpec(path=checkpoint, format="checkpoint"), precision="bf16")
    names = family.adapter_targets(targets, kind)
    # ZeRO-3 is where the trainer keeps peft's own path: the switch this bench compares
    inject_adapter(family.diffusion_model, names, kind, 16, 16.0, 0.0, zero_stage=0 if recompute else 3)
    family.prepare_for_training()
    family.diffusion_model.to(device)
    g = torch.Generator().manual_seed(1)
    side = resolution // 8
    latents = torch.randn(1, 4, side, side, generator=g)
    batch = Batch(latents, torch.randn(1, 77, 768, generator=g), None, torch.randn(latents.shape, generator=g),
                  torch.tensor([0.5]))
    with torch.no_grad():
        x, timestep, kwargs = family.model_inputs(batch)
    x, timestep = x.to(device, torch.bfloat16), timestep.to(device)
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}

    def resident() -> dict:
        fields = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmRSS", "VmHWM")):
                fields[line.split(":")[0]] = int(line.split()[1]) * 1024
        return fields
    if device.type == "cuda":
        # one pass first, untimed: the first loads kernels and makes cuBLAS's and cuDNN's handles and workspaces
        family.diffusion_model(x, timestep, transformer_options={}, **kwargs).float().square().mean().backward()
        for p in family.diffusion_model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
        base = resident()["VmRSS"]
    began = time.perf_counter()
    out = family.diffusion_model(x, timestep, transformer_options={}, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    forward_s = time.perf_counter() - began
    began = time.perf_counter()
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    backward_s = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else resident()["VmHWM"]
    return {"peak_above_weights": peak - base, "forward_s": forward_s, "backward_s": backward_s,
            "layers": len(names), "device": str(device)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/ingraph-adapter-memory/realsize_sd15.safetensors"))
    parser.add_argument("--kind", default="lokr", choices=("lokr", "loha"))
    parser.add_argument("--targets", default="all_linear", help="an adapter target preset (all_layers: convolutions too)")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--measure", choices=("kept", "recomputed"), help=argparse.SUPPRESS)  # the child's part
    opts = parser.parse_args(argv)
    if opts.measure:
        print("RESULT " + json.dumps(measure(str(opts.checkpoint), opts.kind, opts.targets, opts.resolution,
                                             opts.measure == "recomputed")), flush=True)
        return
    if not opts.checkpoint.exists():
        from tools.realsize_models import build_sd15
        print(f"building {opts.checkpoint}", flush=True)
        build_sd15(opts.checkpoint)
    results = {}
    for how in ("kept", "recomputed"):
        done = subprocess.run([sys.executable, __file__, "--checkpoint", str(opts.checkpoint), "--kind", opts.kind,
                               "--targets", opts.targets, "--resolution", str(opts.resolution), "--measure", how],
                              capture_output=True, text=True, timeout=1800)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            raise SystemExit(f"{how}: the measurement failed ({done.returncode}):\n{done.stderr[-3000:]}")
        results[how] = r = json.loads(line[len("RESULT "):])
        print(f"{opts.kind} on {opts.targets} ({r['layers']} layers), SD1.5 at {opts.resolution} px on {r['device']}, "
              f"change {how}: peak {r['peak_above_weights'] / 2**30:.2f} GiB above the weights; forward "
              f"{r['forward_s']:.2f} s, backward {r['backward_s']:.2f} s", flush=True)
    kept, again = results["kept"], results["recomputed"]
    print(f"recomputed / kept: peak {again['peak_above_weights'] / kept['peak_above_weights']:.3f}, backward "
          f"{again['backward_s'] / kept['backward_s']:.3f}")


if __name__ == "__main__":
    main()
