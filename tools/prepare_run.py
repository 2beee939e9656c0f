"""Prepare a trainer run outside a ComfyUI server, with the same library code the nodes use.

Loads a checkpoint with ComfyUI's loader, caches the dataset's latents and text embeddings,
materialises the diffusion model and writes a run spec, so the trainer program can be launched
(and tested, and benchmarked) on its own:

    python tools/prepare_run.py --checkpoint CKPT --images DIR --run-dir RUN [--set train.steps=4 ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bootstrap():
    sys.path.insert(0, str(REPO))
    from tools.comfy_server import comfyui_path
    sys.path.insert(0, str(comfyui_path()))
    if "ingraph_trainer" not in sys.modules:
        package = types.ModuleType("ingraph_trainer")
        package.__path__ = [str(REPO)]
        sys.modules["ingraph_trainer"] = package
    from comfy.cli_args import args
    import torch
    if not torch.cuda.is_available():
        args.cpu = True


def prepare(checkpoint: Path, images: Path, run_dir: Path, overrides: dict, resolution: int = 64,
            bucketing: bool = False) -> Path:
    _bootstrap()
    import comfy.sd
    from ingraph_trainer.cache.store import write_manifest
    from tools.cache_dataset import encode_folder
    from ingraph_trainer.runner.model_source import materialise_model, prediction_of
    from ingraph_trainer.trainer.config import RunSpec, dump_run_spec, spec_from_dict
    import dataclasses

    model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(checkpoint))
    work = run_dir.parent
    dataset, _ = encode_folder(images, work / "cache", clip, vae, resolution, bucketing)
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = write_manifest(run_dir / "dataset.json", dataset, work / "cache")
    spec = RunSpec(run_dir=str(run_dir))
    spec.model.path = str(materialise_model(model, work / "models"))
    spec.model.prediction = prediction_of(model)
    spec.data.manifest = str(manifest)
    spec.output.lora_path = str(run_dir / "lora.safetensors")
    if overrides.get("samples.every"):
        from ingraph_trainer.runner.previews import PreviewSettings, encode_prompts, write_preview_inputs
        prompts = overrides.get("samples.prompts") or ["a photo"]
        settings = PreviewSettings(spec.samples, encode_prompts(clip, prompts, ""), vae)
        settings.spec.prompts = prompts
        spec.samples = write_preview_inputs(settings, run_dir, work / "models")
    data = dataclasses.asdict(spec)
    for dotted, value in overrides.items():
        table, _, key = dotted.rpartition(".")
        (data[table] if table else data)[key] = value
    spec = spec_from_dict(data, "overrides")
    path = run_dir / "run.toml"
    path.write_text(dump_run_spec(spec))
    from ingraph_trainer.trainer.trust import sign_run
    sign_run(run_dir, ["run.toml", "dataset.json"])  # resumable from the Train node like a run it wrote
    return path


def main(argv=None):
    sys.path.insert(0, str(REPO))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--bucketing", action="store_true", help="aspect-ratio buckets (min side 64)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=JSON",
                        help="override a spec field, value as JSON (e.g. train.steps=4, train.precision=\"fp32\")")
    opts = parser.parse_args(argv)
    overrides = {}
    for item in opts.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    print(prepare(opts.checkpoint, opts.images, opts.run_dir, overrides, opts.resolution, opts.bucketing))


if __name__ == "__main__":
    main()
