"""Prepare a trainer run outside a ComfyUI server, with the same runner/ functions the Train node uses.

Loads a checkpoint with ComfyUI's loader, caches the dataset's latents and text embeddings, describes the model
(and the previews' VAE) as the Train node does for a Load Checkpoint node, and writes the run spec with
runner.session.prepare_run, so the trainer program can be launched (and tested, and benchmarked) on its own:

    python tools/prepare_run.py --checkpoint CKPT --images DIR --run-dir RUN [--set train.steps=4 ...]
        [--masks off] [--caption-dropout 0.3 --caption-variants 2 --keep-tags 1]
        [--prior-images DIR --set data.prior_weight=0.5 --set data.prior_fraction=0.5]

The mask and caption flags are Load Training Images' options; they apply to the prior images too.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.bootstrap import bootstrap as _bootstrap  # noqa: E402,F401  (other tools import it from here too)

TRAIN_NODE_ID = "train"


def checkpoint_graph(checkpoint: Path) -> tuple[dict, object]:
    """The API prompt of Load Checkpoint → (Sample Previews) → Train, and a resolver that finds the checkpoint
    where ComfyUI's folder_paths would find it in a server."""
    prompt = {
        "ckpt": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": checkpoint.name}},
        "previews": {"class_type": "InGraphSamplePreviews", "inputs": {"vae": ["ckpt", 2]}},
        TRAIN_NODE_ID: {"class_type": "InGraphTrainLoRA", "inputs": {"model": ["ckpt", 0],
                                                                      "previews": ["previews", 0]}},
    }

    def resolve(folder: str, name: str):
        return str(checkpoint) if folder == "checkpoints" and name == checkpoint.name else None
    return prompt, resolve


def prepare(checkpoint: Path, images: Path, run_dir: Path, overrides: dict, resolution: int = 64,
            bucketing: bool = False, features: dict | None = None, prior_images: Path | None = None) -> Path:
    _bootstrap()
    import dataclasses

    import comfy.sd
    from ingraph_trainer.runner.model_source import hand_off_model, hand_off_vae
    from ingraph_trainer.runner.session import RunDatasets, prepare_run
    from ingraph_trainer.trainer.graph_model import GraphModel
    from ingraph_trainer.trainer.spec import RunSpec, SampleSpec, spec_from_dict
    from tools.cache_dataset import encode_folder

    checkpoint = Path(checkpoint).resolve()
    model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(checkpoint))
    work = run_dir.parent
    features = features or {}
    dataset, _ = encode_folder(images, work / "cache", clip, vae, resolution, bucketing, **features)
    prior_dataset = None
    if prior_images is not None:
        from ingraph_trainer.runner.train_run import check_prior_dataset
        prior_dataset, _ = encode_folder(prior_images, work / "cache", clip, vae, resolution, bucketing, **features)
        check_prior_dataset(dataset, prior_dataset)
    prompt, resolve = checkpoint_graph(checkpoint)
    hand_off = hand_off_model(GraphModel(model), prompt, TRAIN_NODE_ID, "model", work / "models", resolve=resolve)
    previews = previews_vae = None
    if overrides.get("samples.every"):
        from ingraph_trainer.runner.previews import PreviewSettings, encode_prompts
        prompts = overrides.get("samples.prompts") or ["a photo"]
        previews = PreviewSettings(SampleSpec(prompts=prompts), encode_prompts(clip, prompts, ""), vae)
        previews_vae = hand_off_vae(vae, prompt, TRAIN_NODE_ID, work / "models", resolve=resolve)

    def apply_overrides(spec):
        data = dataclasses.asdict(spec)
        for dotted, value in overrides.items():
            table, _, key = dotted.rpartition(".")
            (data[table] if table else data)[key] = value
        return spec_from_dict(data, "overrides")

    # signed like a run the Train node wrote, so it is resumable from the node too
    _, spec_path = prepare_run(RunSpec(model=hand_off.model_spec), runs_root=work, run_dir=run_dir, name="lora",
                               datasets=RunDatasets(dataset, prior=prior_dataset), cache_root=work / "cache",
                               lora_path=run_dir / "lora.safetensors", previews=previews, previews_vae=previews_vae,
                               adjust=apply_overrides)
    return spec_path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--bucketing", action="store_true", help="aspect-ratio buckets (min side 64)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=JSON",
                        help="override a spec field, value as JSON (e.g. train.steps=4, train.precision=\"fp32\")")
    parser.add_argument("--prior-images", type=Path, default=None,
                        help="prior (regularisation) images mixed into every batch (data.prior_weight, "
                             "data.prior_fraction with --set)")
    _bootstrap()
    from tools.cache_dataset import add_feature_flags, dataset_features
    add_feature_flags(parser)
    opts = parser.parse_args(argv)
    overrides = {}
    for item in opts.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    print(prepare(opts.checkpoint, opts.images, opts.run_dir, overrides, opts.resolution, opts.bucketing,
                  dataset_features(opts), opts.prior_images))


if __name__ == "__main__":
    main()
