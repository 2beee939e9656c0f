"""The trainer's peak memory while loading its model, against the weights it holds: ComfyUI's own loader as
the trainer called it before (the whole memory-mapped file stays resident while the model's copy fills) and the
trainer's load_family now (each tensor's pages of the file dropped once copied, trainer/models/loading.py).

Each measurement runs in a fresh process: its peak RSS (VmHWM, reset after the imports; file-backed pages count)
minus its RSS after the imports, over the bytes of the diffusion model's weights once loaded. Linux only.

    python bench/load_memory.py --build-unet bf16 --dir /tmp/loadmem        # the full SD1.5 UNet (860M) as a file
    python bench/load_memory.py --file /tmp/loadmem/sd15_unet_bf16.safetensors --hold bf16 fp8
    python bench/load_memory.py --file realsize_sd15.safetensors --format checkpoint --hold bf16 fp8 fp32

--hold: bf16 / fp32 = the training precision the base is held in (weight_dtype default); fp8 = UNETLoader's
weight_dtype fp8_e4m3fn. Keep to one model at a time: the "before" load of an fp32 file holds twice its size.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HOLDS = {"fp32": ("default", "fp32"), "bf16": ("default", "bf16"), "fp8": ("fp8_e4m3fn", "bf16")}


def measure(path: str, fmt: str, hold: str, how: str) -> dict:
    """In this process (call it in a fresh one): load with `how` (comfyui | trainer), return the figures."""
    import gc
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.sd  # noqa: F401  (imports before the baseline)
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.parallel.memory import load_peak
    from ingraph_trainer.trainer.models import load_family  # noqa: F401  (imports before the baseline)

    weight_dtype, precision = HOLDS[hold]
    spec = ModelSpec(path=path, format=fmt, weight_dtype=weight_dtype)
    gc.collect()
    with load_peak({}) as report:  # the peak restarts here, after the imports
        model = _load(how, path, fmt, spec, precision)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    held = sum(storages.values())
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    return {"held": held, "rise": report["peak"] - report["rss_before"], "dtypes": dtypes}


def _load(how: str, path: str, fmt: str, spec, precision: str):
    import comfy.sd
    from ingraph_trainer.trainer.models import base_storage_options, load_family
    if how == "comfyui":
        options = base_storage_options(spec, precision)
        if fmt == "checkpoint":
            model = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False,
                                                          model_options=options)[0].model.diffusion_model
        else:
            model = comfy.sd.load_diffusion_model(path, model_options=options).model.diffusion_model
    else:
        model = load_family(spec, precision=precision).diffusion_model
    return model


def build_unet(dtype: str, out_dir: Path) -> Path:
    """The full SD1.5 UNet with random weights as a diffusion-model file (what Load Diffusion Model reads)."""
    from tools import realsize_models
    prefix = "model.diffusion_model."
    layout = {k[len(prefix):]: v for k, v in realsize_models.sd15_layout().items() if k.startswith(prefix)}
    out = out_dir / f"sd15_unet_{dtype}.safetensors"
    if not out.exists():
        realsize_models.write_random_safetensors(layout, out, dtype)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", help="a safetensors model file")
    parser.add_argument("--format", default="diffusion_model", choices=["diffusion_model", "checkpoint"])
    parser.add_argument("--hold", nargs="+", default=["bf16", "fp8"], choices=list(HOLDS))
    parser.add_argument("--how", nargs="+", default=["comfyui", "trainer"], choices=["comfyui", "trainer"])
    parser.add_argument("--build-unet", choices=["fp32", "bf16", "fp16"], help="write the SD1.5 UNet in --dir")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ingraph_load_memory"))
    parser.add_argument("--one", nargs=4, metavar=("FILE", "FORMAT", "HOLD", "HOW"), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.one:
        print(json.dumps(measure(*opts.one)))
        return 0
    if opts.build_unet:
        print(build_unet(opts.build_unet, opts.dir))
        return 0
    if not opts.file:
        parser.error("give --file (or --build-unet DTYPE to write one)")
    size = Path(opts.file).stat().st_size
    print(f"{opts.file} ({opts.format}, {size / 2**20:.0f} MiB on disk)")
    for hold in opts.hold:
        for how in opts.how:
            done = subprocess.run([sys.executable, __file__, "--one", opts.file, opts.format, hold, how],
                                  capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            got = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"hold {hold:4s} {how:8s}: weights held {got['held'] / 2**20:7.0f} MiB "
                  f"({'/'.join(got['dtypes'])}), peak rise {got['rise'] / 2**20:7.0f} MiB = "
                  f"{got['rise'] / got['held']:.2f} x held", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
