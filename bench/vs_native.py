"""Steady-state seconds per step: ComfyUI's own TrainLoraNode vs our Train LoRA, in one ComfyUI server.

Same checkpoint (the embedded tiny SD1.5), same 8 images at 64x64, same rank, batch size and
precision. Ours runs with our default targets (attention) and with TrainLoraNode's own placement ("all linear and
convolution layers": a LoRA on every weight of two or more dimensions); TrainLoraNode also trains a full diff of
every bias and norm weight, which ours does not (the parameter counts are printed from both files). TrainLoraNode reports no per-step progress, so its steady state is measured
differentially: (time of a long run - time of a short run) / (step difference), which cancels its
set-up. Ours is measured the same way, and also read from the trainer's own step events.

    python bench/vs_native.py [--short 10 --long 40 --rank 8 --batch 2 --precision bf16]

Against ComfyUI 0.33 (its TrainLoraNode is a v3 node with more inputs; each takes its default):
    COMFYUI_PATH=/opt/ComfyUI-0.33 PYTHONPATH=$PWD/.venv/comfyui-0.33 python bench/vs_native.py
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from client.api import ComfyClient  # noqa: E402
from tools.comfy_server import ComfyServer, comfyui_available  # noqa: E402
from tools.embedded_default import build_checkpoint, build_images  # noqa: E402

CKPT = "ingraph_tiny_sd15.safetensors"


def native_workflow(steps, rank, batch, precision, seed, checkpoint=CKPT, images="bench_images", prefix=None,
                    dataset_nodes="0.3.64"):
    """ComfyUI's own TrainLoraNode on a checkpoint and an image folder (bench/realsize.py uses it too).
    `dataset_nodes`: "0.3.64" (LoadImageTextSetFromFolderNode, VAEEncode) or "0.33" (its v3 dataset nodes:
    LoadImageTextDataSetFromFolder, MakeTrainingDataset); `native_dataset_nodes` tells which a server has."""
    if dataset_nodes == "0.33":
        dataset = {
            "2": {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": images}},
            "3": {"class_type": "MakeTrainingDataset",
                  "inputs": {"images": ["2", 0], "vae": ["1", 2], "clip": ["1", 1], "texts": ["2", 1]}},
        }
        latents, positive = ["3", 0], ["3", 1]
    else:
        dataset = {
            "2": {"class_type": "LoadImageTextSetFromFolderNode",
                  "inputs": {"folder": images, "clip": ["1", 1], "resize_method": "None", "width": -1,
                             "height": -1}},
            "3": {"class_type": "VAEEncode", "inputs": {"pixels": ["2", 0], "vae": ["1", 2]}},
        }
        latents, positive = ["3", 0], ["2", 1]
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": checkpoint}},
        **dataset,
        "4": {"class_type": "TrainLoraNode",
              "inputs": {"model": ["1", 0], "latents": latents, "positive": positive, "batch_size": batch,
                         "grad_accumulation_steps": 1, "steps": steps, "learning_rate": 1e-3, "rank": rank,
                         "optimizer": "AdamW", "loss_function": "MSE", "seed": seed, "training_dtype": precision,
                         "lora_dtype": precision, "algorithm": "LoRA", "gradient_checkpointing": False,
                         "existing_lora": "[None]"}},
        # 0.33: the LoRA is the first output (0.3.64: the second, after the model)
        "5": {"class_type": "SaveLoRA" if dataset_nodes == "0.33" else "SaveLoRANode",
              "inputs": {"lora": ["4", 0 if dataset_nodes == "0.33" else 1],
                         "prefix": f"loras/{prefix or f'native_{steps}'}"}},
    }


def ours_workflow(steps, rank, batch, precision, seed, targets):
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}},
        "2": {"class_type": "InGraphLoadTrainingImages",
              "inputs": {"folder": "bench_images", "resolution": 64, "bucketing": False, "min_side": 64,
                         "max_side": 256, "max_upscale": 1.0, "crop": "center", "flip": False,
                         "repeats": 1, "caption_prefix": "",
                         "missing_caption": "error", "default_caption": ""}},
        "3": {"class_type": "InGraphCacheLatents", "inputs": {"dataset": ["2", 0], "vae": ["1", 2]}},
        "4": {"class_type": "InGraphCacheTextEmbeddings", "inputs": {"dataset": ["3", 0], "clip": ["1", 1]}},
        "5": {"class_type": "InGraphLoRAAdapter",
              "inputs": {"kind": "LoRA", "rank": rank, "alpha": float(rank), "dropout": 0.0, "targets": targets}},
        "6": {"class_type": "InGraphTrainLoRA",
              "inputs": {"model": ["1", 0], "dataset": ["4", 0], "adapter": ["5", 0], "steps": steps,
                         "batch_size": batch, "gradient_accumulation": 1, "learning_rate": 1e-3,
                         "optimizer": "AdamW", "lr_schedule": "constant", "warmup_steps": 0, "precision": precision,
                         "gradient_checkpointing": False, "seed": seed, "save_every": 0,
                         "output_name": f"bench_ours_{targets.replace(' ', '_')}_{steps}"}},
    }


# TrainLoraNode's LoRA goes on every weight of two or more dimensions: our preset with the same layers, beside our default
SAME_PLACEMENT = "all linear and convolution layers"
TARGETS = ("attention", SAME_PLACEMENT)


def trained_tensors(base: Path, prefix: str) -> tuple[int, int, int]:
    """A saved adapter's (layers with a low-rank update, their parameters, bias/norm diff parameters), read from the
    file the run wrote (SaveLoRA's under output/, ours under models/loras; TrainLoraNode's .diff/.diff_b tensors are
    the bias/norm part)."""
    from cache.files import safetensors_header
    files = sorted(base.rglob(f"{prefix}*.safetensors"))
    if not files:
        raise RuntimeError(f"no adapter file {prefix}* under {base}")
    header = safetensors_header(files[-1]) or {}
    header.pop("__metadata__", None)
    low_rank, diffs, layers = 0, 0, set()
    for key, info in header.items():
        if key.endswith((".diff", ".diff_b")):
            diffs += math.prod(info["shape"])
        elif not key.endswith(".alpha"):
            low_rank += math.prod(info["shape"])
            layers.add(key.rsplit(".", 2 if key.endswith(".weight") else 1)[0])
    return len(layers), low_rank, diffs


def native_dataset_nodes(client) -> str:
    """Which of native_workflow's dataset graphs the server's ComfyUI has."""
    try:
        client.get("/object_info/MakeTrainingDataset")["MakeTrainingDataset"]
        return "0.33"
    except (KeyError, OSError):
        return "0.3.64"


def fit_to_schema(client, wf: dict) -> dict:
    """The workflow as the running ComfyUI's nodes take it: inputs a node no longer has dropped, inputs it has gained
    set to their defaults (TrainLoraNode gained bypass, offloading, checkpoint depth and buckets in 0.33), so the
    same comparison runs on 0.3.64 and 0.33 with each side's own defaults for what the other lacks."""
    fitted = {}
    for node_id, node in wf.items():
        schema = client.get(f"/object_info/{node['class_type']}")[node["class_type"]]["input"]
        known = {**schema.get("required", {}), **schema.get("optional", {})}
        inputs = {k: v for k, v in node["inputs"].items() if k in known}
        for name, spec in schema.get("required", {}).items():
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if name not in inputs and "default" in options:
                inputs[name] = options["default"]
        fitted[node_id] = {**node, "inputs": inputs}
    return fitted


def node_seconds(outcome, node: str) -> float:
    """Wall time from the 'executing' message for `node` to the next 'executing' (or the end of the prompt)."""
    marks = [(m["_t"], (m.get("data") or {}).get("node")) for m in outcome.messages
             if m.get("type") in ("executing", "execution_success")]
    for (t0, n), (t1, _) in zip(marks, marks[1:]):
        if n == node:
            return t1 - t0
    raise RuntimeError(f"node {node} did not run: {outcome.status} {outcome.error}")


def timed_run(client, wf):
    t_queue = time.monotonic()
    first_step = {}

    def stamp(message):
        message["_t"] = time.monotonic()
        if message.get("type") == "ingraph.event" and message["data"]["event"]["type"] == "step":
            first_step.setdefault("t", message["_t"])
    outcome = client.run(fit_to_schema(client, wf), timeout=3600, on_message=stamp)
    if not outcome.ok:
        raise RuntimeError(f"{outcome.status}: {outcome.error}")
    return outcome, (first_step.get("t", t_queue) - t_queue)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=40)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    opts = parser.parse_args(argv)
    if not comfyui_available():
        sys.exit("ComfyUI not found (set COMFYUI_PATH)")
    with tempfile.TemporaryDirectory(prefix="ingraph-bench-") as tmp:
        base = Path(tmp)
        build_checkpoint(base / "models" / "checkpoints" / CKPT)
        build_images(base / "input" / "bench_images", count=8, size=64)
        with ComfyServer(base) as server:
            client = ComfyClient(server.address)
            args = (opts.rank, opts.batch, opts.precision)
            native = dict(dataset_nodes=native_dataset_nodes(client))
            # warm-up: caches, first model load
            timed_run(client, native_workflow(2, *args, seed=99, **native))
            timed_run(client, ours_workflow(2, *args, seed=99, targets="attention"))
            results = {}
            n_short, _ = timed_run(client, native_workflow(opts.short, *args, seed=1, **native))
            n_long, _ = timed_run(client, native_workflow(opts.long, *args, seed=1, **native))
            results["native"] = (node_seconds(n_long, "4") - node_seconds(n_short, "4")) / (opts.long - opts.short)
            first_step, trained = {}, {"native": trained_tensors(base, f"native_{opts.long}")}
            for targets in TARGETS:
                o_short, _ = timed_run(client, ours_workflow(opts.short, *args, seed=1, targets=targets))
                o_long, first_step[targets] = timed_run(client, ours_workflow(opts.long, *args, seed=1, targets=targets))
                diff = (node_seconds(o_long, "6") - node_seconds(o_short, "6")) / (opts.long - opts.short)
                steps = [m["data"]["event"]["step_time_s"] for m in o_long.messages
                         if m.get("type") == "ingraph.event" and m["data"]["event"]["type"] == "step"][2:]
                results[targets] = (diff, statistics.median(steps))
                trained[targets] = trained_tensors(base, f"bench_ours_{targets.replace(' ', '_')}_{opts.long}")
            client.close()
    native = results["native"]
    from trainer.comfy_compat import comfyui_version
    from tools.comfy_server import comfyui_path
    version = ".".join(map(str, comfyui_version(comfyui_path()))) or "?"
    print(f"setup: ComfyUI {version}, tiny SD1.5, 8 images 64x64, rank {opts.rank}, batch {opts.batch}, "
          f"{opts.precision}, steps {opts.short} vs {opts.long}, CPU")
    layers, low_rank, diffs = trained["native"]
    print(f"native TrainLoraNode (LoRA on every weight of 2+ dimensions, a full diff of every bias and norm): "
          f"{native:.4f} s/step; its file: {layers} layers, {low_rank:,} low-rank + {diffs:,} bias/norm parameters")
    for targets in TARGETS:
        diff, median = results[targets]
        layers, low_rank, _ = trained[targets]
        print(f"ours, targets={targets!r}: {diff:.4f} s/step (differential), {median:.4f} s/step (trainer events), "
              f"queue to first step {first_step[targets]:.1f} s; its file: {layers} layers, {low_rank:,} parameters")
    print("ratio ours/native s/step: " + "; ".join(f"{t} {results[t][0] / native:.3f}" for t in TARGETS))
    print(f"ratio ours/native, the same layers ({SAME_PLACEMENT}): {results[SAME_PLACEMENT][0] / native:.3f}")


if __name__ == "__main__":
    main()
