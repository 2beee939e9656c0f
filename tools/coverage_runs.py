"""The coverage run's training (tools/family_coverage.py --train): each tiny model trained as a user's run is, by the
trainer program itself.

The model is a file in a diffusion-models folder, handed to the trainer by the Train node's own hand-off
(runner.model_source, as for a Load Diffusion Model node); its dataset is two items written to a cache as the cache
nodes write theirs (a latent entry per item, a text entry per caption), with random tensors of the shapes the
family's encoders give (tools/family_coverage.py random_batch), since the real encoders are too large for this
machine; the run spec is written by runner.session.prepare_run, and `python <pack>/trainer --config SPEC` trains 2
steps and writes the adapter file that ComfyUI's LoRA loader then reads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN_NODE = "train"
LOADER_NODE = "unet"


@dataclass
class ProgramRun:
    """What one coverage run of the trainer program gave: "yes" or why not, the adapter file, seconds per step."""
    trained: str
    adapter: Path | None = None
    step_s: float | None = None


def cache_batch(batch, cache_root: Path, name: str):
    """The items of `batch` (a trainer Batch of random tensors) written to the cache at `cache_root` as the cache
    nodes write theirs: each item's latent (and audio latent) in a latent entry, its text (pooled vector, attention
    mask and the encoder's extra outputs) in a text entry; plus the empty caption, which every cached dataset has.
    Returns the cached TrainingDataset, one item per batch row, its images 8 px per latent cell."""
    import torch
    from ingraph_trainer.cache.buckets import BucketSettings
    from ingraph_trainer.cache.dataset import DatasetItem, TrainingDataset
    from ingraph_trainer.cache.encoding import TEXT_EXTRA, record_usage
    from ingraph_trainer.cache.store import CacheStore
    import hashlib
    extras = dict(batch.text_extras or {})

    def key(what: str) -> str:  # a cache key is a digest, as encoding.latent_key and text_key make them
        return hashlib.sha256(f"{name}/{what}".encode()).hexdigest()
    height, width = batch.latents.shape[-2:]
    video = batch.latents.dim() == 5 and batch.latents.shape[2] > 1  # (one latent frame: a video VAE's image)
    frames = 4 * (batch.latents.shape[2] - 1) + 1 if video else 0  # a 4x temporal VAE's frames for its latents
    store = CacheStore(cache_root)
    items = []
    try:
        with store.caching_pass():
            def text_entry(n: int, caption: str, zero: bool = False):
                pick = (lambda t: torch.zeros_like(t[n])) if zero else (lambda t: t[n])
                tensors = {"cond": pick(batch.cond)}
                if batch.pooled is not None:
                    tensors["pooled"] = pick(batch.pooled)
                if batch.text_mask is not None:
                    tensors["attention_mask"] = batch.text_mask[n]
                tensors.update({TEXT_EXTRA + k: v[n:n + 1] for k, v in extras.items()})  # as the encoder returns them
                entry = store.put("text", key(caption), tensors, {"caption": caption})
                return entry.key, entry.checksum
            for n in range(batch.latents.shape[0]):
                latent = {"latent": batch.latents[n]}
                if batch.audio is not None:
                    latent["audio"] = batch.audio[n]
                entry = store.put("latent", key(f"latent {n}"), latent, {"source": f"random {n}"})
                text, text_sha = text_entry(n, f"random {n}")
                items.append(DatasetItem(path=f"random-{n}.png", caption=f"random {n}", bucket=(8 * width, 8 * height),
                                         latent=entry.key, latent_sha=entry.checksum, text=text, text_sha=text_sha,
                                         frames=frames))
            empty = text_entry(0, "", zero=True)
            dataset = TrainingDataset(
                folder=f"random:{name}", items=tuple(items), buckets=BucketSettings(resolution=8 * width),
                latent_encoder=f"random:{name}", text_encoder=f"random:{name}", empty_text=empty,
                audio_encoder=f"random:{name}" if batch.audio is not None else "", keeps_text_extras=bool(extras),
                video=(24.0, "start", (frames,)) if video else ())
            record_usage(dataset, store)
    finally:
        store.close()
    return dataset


def prepare_program_run(patcher, model_file: Path, dataset, run_dir: Path, rank: int, alpha: float,
                        one_caption_a_call: bool = False):
    """The run spec of a 2-step LoRA run on `dataset` of the MODEL `patcher` loaded from `model_file` (as Load
    Diffusion Model loads it: the hand-off describes it by that file), written as the Train node writes one: the
    whole dataset a batch, or (`one_caption_a_call`) one item a micro-batch, accumulated."""
    from ingraph_trainer.runner.model_source import hand_off_model
    from ingraph_trainer.runner.session import RunDatasets, prepare_run
    from ingraph_trainer.trainer.graph_model import GraphModel
    from ingraph_trainer.trainer.spec import RunSpec, spec_from_dict
    work = run_dir.parent
    prompt = {LOADER_NODE: {"class_type": "UNETLoader", "inputs": {"unet_name": model_file.name,
                                                                   "weight_dtype": "default"}},
              TRAIN_NODE: {"class_type": "InGraphTrainLoRA", "inputs": {"model": [LOADER_NODE, 0]}}}

    def resolve(folder: str, name: str):
        return str(model_file) if folder == "diffusion_models" and name == model_file.name else None
    hand_off = hand_off_model(GraphModel(patcher), prompt, TRAIN_NODE, "model", work / "models", resolve=resolve)
    if hand_off.materialised:  # the point is the file a user's loader reads
        raise RuntimeError(f"{model_file.name} was materialised, not handed to the trainer as its file")

    def settings(spec):
        import dataclasses
        data = dataclasses.asdict(spec)
        batch = 1 if one_caption_a_call else len(dataset.items)
        data["train"].update(steps=2, batch_size=batch, grad_accum=len(dataset.items) // batch, precision="fp32",
                             learning_rate=1e-3, eval_quantiles=[], memory="manual", seed=0)
        data["adapter"].update(kind="lora", rank=rank, alpha=alpha, targets="attention")
        return spec_from_dict(data, "coverage")
    _, spec_path = prepare_run(RunSpec(model=hand_off.model_spec), runs_root=work, run_dir=run_dir, name="lora",
                               datasets=RunDatasets(dataset), cache_root=work / "cache",
                               lora_path=run_dir / "lora.safetensors", adjust=settings)
    return spec_path


def run_program(spec_path: Path, timeout: float = 900) -> ProgramRun:
    """`python <pack>/trainer --config SPEC`, as the Train node starts it: "yes" with the adapter and the mean step
    time where it finished with one, else the run's error (its last error event, or the end of its output)."""
    from ingraph_trainer.trainer.run.layout import EVENTS_FILE
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run([sys.executable, str(REPO / "trainer"), "--config", str(spec_path)], cwd=spec_path.parent,
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return ProgramRun(f"no: the trainer ran past {timeout:.0f} s")
    events_file = spec_path.parent / EVENTS_FILE
    events = []
    for line in events_file.read_text().splitlines() if events_file.exists() else ():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed trainer
            continue
    steps = [e for e in events if e.get("type") == "step"]
    finished = next((e for e in events if e.get("type") == "finished"), None)
    if proc.returncode == 0 and finished and finished.get("adapter") and len(steps) == 2:
        step_s = sum(e["step_time_s"] for e in steps) / len(steps)
        return ProgramRun("yes", Path(finished["adapter"]), step_s)
    error = next((e for e in reversed(events) if e.get("type") == "error"), None)
    output = (proc.stderr + proc.stdout).strip()
    print("  the trainer's output ends:\n    " + "\n    ".join(output.splitlines()[-15:]), flush=True)
    why = error["message"] if error else f"no error event; its log: {(output.splitlines() or ['nothing'])[-1]}"
    return ProgramRun(f"no: exit {proc.returncode}: {' '.join(why.split())}")


def train_with_program(patcher, state: dict, metadata: dict | None, batch, work: Path, label: str, rank: int,
                       alpha: float) -> ProgramRun:
    """The tiny model's weights as a file, `batch` as a cached dataset, 2 steps by the trainer program."""
    from safetensors.torch import save_file
    started = time.perf_counter()
    models = work / "diffusion_models"
    models.mkdir(parents=True, exist_ok=True)
    model_file = models / ("".join(c if c.isalnum() else "_" for c in label) + ".safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, str(model_file), metadata=metadata)
    dataset = cache_batch(batch, work / "cache", model_file.stem)
    from ingraph_trainer.trainer.data.loading import ONE_CAPTION_AT_A_TIME
    run = run_program(prepare_program_run(patcher, model_file, dataset, work / "run", rank, alpha))
    if ONE_CAPTION_AT_A_TIME in run.trained:  # as the trainer's refusal tells a user to (Anima, MiniMax H3)
        run = run_program(prepare_program_run(patcher, model_file, dataset, work / "run-accumulated", rank, alpha,
                                              one_caption_a_call=True))
    print(f"  trainer program: {run.trained} ({time.perf_counter() - started:.1f} s)", flush=True)
    return ProgramRun(run.trained[:200], run.adapter, run.step_s)
