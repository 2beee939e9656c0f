"""Hand the graph's MODEL (and the previews' VAE) to the trainer without copying weights.

A MODEL does not record its source file, but the prompt does: the loader node upstream names the file, and
LoRA loaders between it and the consumer name their patches. `describe_model` walks the API prompt from a
node's input link back to the loader and returns that description (files by path, identified by size and
mtime, never by hashing their contents); the trainer rebuilds the same weights with ComfyUI's own loading and
patching code. Only a MODEL whose patches cannot be described that way is materialised (materialise.py): its
patched weights written once under the pack's data folder, keyed by the upstream graph.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..trainer.graph_model import GraphModel
from .materialise import materialise_model, materialise_vae

log = logging.getLogger("ingraph_trainer")


# nodes that change only the MODEL's options, never its weights (checked in ComfyUI 0.3.64's
# comfy_extras/nodes_model_advanced.py: each clones the MODEL and adds an object patch of "model_sampling")
OPTION_ONLY_NODES = {"ModelSamplingDiscrete", "ModelSamplingSD3", "ModelSamplingAuraFlow", "ModelSamplingFlux"}
LORA_LOADERS = {"LoraLoader", "LoraLoaderModelOnly"}
TRAIN_NODES = {"InGraphTrainLoRA", "InGraphDistill"}  # their output MODEL is recorded (record_trained_output)
# VAELoader names that are built in code, not read from a file in models/vae
BUILT_IN_VAES = {"pixel_space", "taesd", "taesdxl", "taesd3", "taef1", "taef2"}  # taef2: ComfyUI 0.33's


class Undescribable(Exception):
    """The MODEL (or VAE) cannot be described by files: the message names the node that forced it."""

    def __init__(self, node_id, class_type: str, reason: str):
        super().__init__(f"node {node_id} ({class_type}): {reason}")
        self.node_id, self.class_type = node_id, class_type


@dataclass(frozen=True)
class ModelSource:
    """Where a MODEL's weights come from: a file as its loader read it, then adapter files applied in order."""
    path: str
    format: str = "diffusion_model"  # trainer.spec.MODEL_FORMATS
    weight_dtype: str = "default"
    loras: tuple = ()  # ((path, strength), ...)

    def with_lora(self, path: str, strength: float) -> "ModelSource":
        return ModelSource(self.path, self.format, self.weight_dtype, (*self.loras, (str(path), float(strength))))

    def model_spec(self, prediction: str):
        """The run spec's model section for this source, stamped now."""
        from ..trainer.spec import ModelSpec
        lora_paths = [p for p, _ in self.loras]
        return ModelSpec(path=self.path, format=self.format, weight_dtype=self.weight_dtype, lora_paths=lora_paths,
                         lora_strengths=[s for _, s in self.loras],
                         stamps=[file_stamp(p) for p in (self.path, *lora_paths)], prediction=prediction)


@dataclass(frozen=True)
class VaeSource:
    path: str
    format: str  # trainer.spec.VAE_FORMATS


def file_stamp(path: str | Path) -> str:
    """"size:mtime_ns", as the trainer checks it (trainer.models.file_stamp: one definition for both sides)."""
    from ..trainer.models import file_stamp as stamp
    return stamp(str(path))


# --- what a Train node produced, so that its output MODEL is described as its source plus the new file --------

@dataclass
class _TrainedOutput:
    source: ModelSource
    patches_uuid: object  # the output ModelPatcher's weight-patch identity (kept by clones, changed by new patches)


_TRAINED: dict[str, _TrainedOutput] = {}


def record_trained_output(node_id: str, trained: GraphModel, source: ModelSource | None):
    """Remembers what Train node `node_id` output (None: not describable, downstream nodes materialise it)."""
    if source is None:
        _TRAINED.pop(str(node_id), None)
    else:
        _TRAINED[str(node_id)] = _TrainedOutput(source, trained.patches_uuid)


def trained_output_source(adapter_path: str, input_source: ModelSource | None, *, full: bool,
                          file_format: str) -> ModelSource | None:
    """A Train node's output MODEL as files: a full fine-tune is its own file; an adapter is applied at strength 1
    on the input's source (the diffusers layout is converted before ComfyUI applies it, so it is not a file
    ComfyUI's loader reads as is)."""
    if full:
        return ModelSource(str(adapter_path), "diffusion_model")
    if input_source is None or file_format == "diffusers":
        return None
    return input_source.with_lora(str(adapter_path), 1.0)


# --- the walk ------------------------------------------------------------------------------------------------

def _folder_file(folder: str, name) -> str | None:
    import folder_paths
    return folder_paths.get_full_path(folder, name) if isinstance(name, str) else None


def _literal(node_id, node: dict, name: str, kind):
    value = node.get("inputs", {}).get(name)
    if isinstance(value, list) or not isinstance(value, kind) or isinstance(value, bool):
        raise Undescribable(node_id, node.get("class_type", "?"), f"{name} is not a plain value ({value!r})")
    return value


def _file(node_id, node: dict, input_name: str, folder: str, resolve) -> str:
    name = _literal(node_id, node, input_name, str)
    path = resolve(folder, name)
    if not path or not os.path.isfile(path):
        raise Undescribable(node_id, node["class_type"], f"{name!r} is not a file in models/{folder}")
    if not path.lower().endswith(".safetensors"):
        raise Undescribable(node_id, node["class_type"], f"{name!r} is not a .safetensors file")
    return str(path)


def _link(node_id, node: dict, name: str):
    link = node.get("inputs", {}).get(name)
    if not (isinstance(link, list) and len(link) == 2):
        raise Undescribable(node_id, node.get("class_type", "?"), f"its {name} input is not a link")
    return link


def _walk(prompt: dict, link, resolve, depth: int = 0) -> tuple[ModelSource, object]:
    """(source, last weight change: None | "lora" | "any" | ("trained", patches_uuid)) of the MODEL at `link`."""
    node_id, output = str(link[0]), link[1]
    node = prompt.get(node_id)
    if not isinstance(node, dict) or depth > 256:
        raise Undescribable(node_id, "?", "not in the prompt")
    kind = node.get("class_type", "?")
    if output != 0:
        raise Undescribable(node_id, kind, f"output {output} is not the MODEL output this pack knows")
    if kind == "CheckpointLoaderSimple":
        return ModelSource(_file(node_id, node, "ckpt_name", "checkpoints", resolve), "checkpoint"), None
    if kind == "UNETLoader":
        from ..trainer.spec import WEIGHT_DTYPES
        dtype = _literal(node_id, node, "weight_dtype", str)
        if dtype not in WEIGHT_DTYPES:
            raise Undescribable(node_id, kind, f"weight_dtype {dtype!r} is not one of {WEIGHT_DTYPES}")
        return ModelSource(_file(node_id, node, "unet_name", "diffusion_models", resolve), "diffusion_model",
                           dtype), None
    if kind in LORA_LOADERS:
        upstream, last = _walk(prompt, _link(node_id, node, "model"), resolve, depth + 1)
        strength = float(_literal(node_id, node, "strength_model", (int, float)))
        if strength == 0:  # ComfyUI adds no change to the weights (LoraLoader may add zero-strength patches)
            return upstream, "any" if last is None else last
        return upstream.with_lora(_file(node_id, node, "lora_name", "loras", resolve), strength), "lora"
    if kind in OPTION_ONLY_NODES:
        return _walk(prompt, _link(node_id, node, "model"), resolve, depth + 1)
    if kind in TRAIN_NODES:
        record = _TRAINED.get(node_id)
        if record is None:
            raise Undescribable(node_id, kind, "its output was not recorded in this process")
        missing = [p for p in (record.source.path, *(p for p, _ in record.source.loras)) if not os.path.isfile(p)]
        if missing:
            raise Undescribable(node_id, kind, f"{missing[0]} no longer exists")
        return record.source, ("trained", record.patches_uuid)
    raise Undescribable(node_id, kind, "a node whose effect on the weights this pack cannot describe")


def describe_model(prompt: dict | None, link, model: GraphModel | None = None, resolve=_folder_file) -> ModelSource:
    """The files the MODEL at `link` ([node id, output]) was loaded and patched from; raises Undescribable.

    With the live `model`, its weight patches must agree with the description (a prompt that does not match the
    executed graph is not trusted)."""
    if not isinstance(prompt, dict):
        raise Undescribable("?", "?", "no prompt (the node was run outside a ComfyUI graph)")
    if not (isinstance(link, list) and len(link) == 2):
        raise Undescribable("?", "?", "the model input is not a link")
    source, last = _walk(prompt, link, resolve)
    if model is not None:
        patches = model.patches
        if isinstance(last, tuple):
            agrees = model.patches_uuid == last[1]
        elif last is None:
            agrees = not patches
        elif last == "lora":
            agrees = bool(patches)
        else:
            agrees = True
        if not agrees:
            node = prompt.get(str(link[0]), {})
            raise Undescribable(link[0], node.get("class_type", "?"), "the MODEL's patches differ from the prompt's")
        if not isinstance(last, tuple) and not _file_holds_the_base(source, model):
            node = prompt.get(str(link[0]), {})
            raise Undescribable(link[0], node.get("class_type", "?"),
                                f"{os.path.basename(source.path)} on disk is not what the MODEL holds (rewritten "
                                "since ComfyUI loaded it)")
        if last == "lora":
            stale = next((path for path, _ in source.loras if not _file_is_in_patches(path, patches)), None)
            if stale is not None:
                node = prompt.get(str(link[0]), {})
                raise Undescribable(link[0], node.get("class_type", "?"),
                                    f"{os.path.basename(stale)} on disk is not what the MODEL holds (rewritten "
                                    "since ComfyUI loaded it)")
    return source


BASE_PROBES = 4  # weights compared between a base file and the live MODEL
BASE_PROBE_ELEMENTS = 4096  # strided elements of each
BASE_SAME_COSINE = 0.999  # the same weights after any cast ComfyUI applies (fp8 rounding: ~0.9995 and up)


def _file_holds_the_base(source: "ModelSource", model: GraphModel) -> bool:
    """Whether the base file on disk holds the weights the live MODEL was loaded with. ComfyUI keeps a loader's
    output cached while the file under its name is rewritten (a re-download), and the trainer would rebuild from the
    new file. Compares a strided sample of a few weights the MODEL holds unpatched (ComfyUI's copies are unpatched
    once released) with the file's tensors of the same name, by cosine similarity (the MODEL may hold them cast, to
    fp8 or bf16). True where nothing can be compared (renamed keys, quantized or offloaded weights)."""
    import torch
    from safetensors import safe_open
    live, patches = model.diffusion_parameters(), model.patches
    if live is None:
        return True
    prefix = "model.diffusion_model." if source.format == "checkpoint" else ""
    try:
        with safe_open(source.path, "pt") as f:
            keys = set(f.keys())
            names = [n for n, p in live.items() if prefix + n in keys and p.dim() >= 2 and p.numel() >= 1024
                     and f"diffusion_model.{n}" not in patches and p.device.type != "meta"]
            step = max(1, len(names) // BASE_PROBES)
            for name in names[::step][:BASE_PROBES]:
                held = live[name].detach().reshape(-1)
                stride = max(1, held.numel() // BASE_PROBE_ELEMENTS)
                a = held[::stride].float().cpu()
                on_disk = f.get_tensor(prefix + name).reshape(-1)[::stride].float()
                if a.shape != on_disk.shape or not torch.isfinite(on_disk).all():
                    return False
                if a.abs().max() == 0 and on_disk.abs().max() == 0:
                    continue
                if torch.nn.functional.cosine_similarity(a, on_disk, dim=0) < BASE_SAME_COSINE:
                    return False
    except (OSError, RuntimeError, TypeError, ValueError) as exc:  # a quantized layout, an unreadable file
        log.debug("InGraph Trainer: base file check skipped for %s (%s)", source.path, exc)
        return True
    return True


def _patch_tensors(patches: dict):
    """The tensors ComfyUI's LoRA patches hold (weight adapters keep the loaded file's tensors as they are)."""
    import torch
    for patch_list in (patches or {}).values():
        for patch in patch_list:
            value = patch[1] if isinstance(patch, tuple) and len(patch) > 1 else None
            weights = getattr(value, "weights", None)
            if weights is None and isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], tuple):
                weights = value[1]  # ("kind", (tensors...)) patches
            for tensor in weights or ():
                if isinstance(tensor, torch.Tensor):
                    yield tensor


TEXT_ENCODER_KEY_PREFIXES = ("lora_te", "text_encoder", "te_", "te1", "te2", "clip", "lora_clip")


def _file_is_in_patches(path: str, patches: dict, probes: int = 16) -> bool:
    """Whether a LoRA file's matrices are among the MODEL's patches: LoraLoader's output stays cached while the file
    under its name is rewritten (a Train node re-using its output_name), and then the file is not what the graph
    holds. Compares up to `probes` of the file's 2-D tensors (small: a LoRA's factors) by value."""
    import torch
    from safetensors import safe_open
    held: dict[tuple, list] = {}
    for tensor in _patch_tensors(patches):
        held.setdefault(tuple(tensor.shape), []).append(tensor)
    try:
        with safe_open(path, "pt") as f:
            # the text encoder's matrices (kohya's lora_te*) patch the CLIP, not the MODEL: compared last
            names = sorted((k for k in f.keys() if len(f.get_slice(k).get_shape()) == 2),
                           key=lambda k: (k.startswith(TEXT_ENCODER_KEY_PREFIXES), k))
            for name in names[:probes]:
                tensor = f.get_tensor(name)
                if any(torch.equal(tensor, h.to(tensor.device, tensor.dtype))
                       for h in held.get(tuple(tensor.shape), ())):
                    return True
    except Exception:  # noqa: BLE001 - a file ComfyUI could not have loaded either: not what the MODEL holds
        return False
    return not names  # nothing to compare by (no matrices): trust the stamp


def describe_vae(prompt: dict | None, link, resolve=_folder_file) -> VaeSource:
    if not isinstance(prompt, dict) or not (isinstance(link, list) and len(link) == 2):
        raise Undescribable("?", "?", "no prompt or no VAE link")
    node_id, output = str(link[0]), link[1]
    node = prompt.get(node_id) or {}
    kind = node.get("class_type", "?")
    if kind == "CheckpointLoaderSimple" and output == 2:
        return VaeSource(_file(node_id, node, "ckpt_name", "checkpoints", resolve), "checkpoint")
    if kind == "VAELoader" and output == 0:
        if node.get("inputs", {}).get("vae_name") in BUILT_IN_VAES:
            raise Undescribable(node_id, kind, "a built-in VAE, not a file")
        return VaeSource(_file(node_id, node, "vae_name", "vae", resolve), "vae")
    raise Undescribable(node_id, kind, "a node whose VAE this pack cannot describe")


def input_link(prompt: dict | None, node_id, input_name: str):
    """The [node id, output] link feeding `input_name` of node `node_id` in the prompt, or None."""
    node = prompt.get(str(node_id)) if isinstance(prompt, dict) else None
    link = (node or {}).get("inputs", {}).get(input_name)
    return link if isinstance(link, list) and len(link) == 2 else None


# --- the GPU goes to the trainer ------------------------------------------------------------------------------

def release_comfy_models(model: GraphModel) -> int:
    """Unloads ComfyUI's loaded models (diffusion model, encoders) and empties its cache, so the trainer gets the
    whole device (GraphModel.release). Returns how many loaded models remain."""
    remaining, holds_trained = model.release()
    log.info("InGraph Trainer: ComfyUI holds %d loaded model(s) as the trainer starts (the trained model: %s)",
             remaining, "loaded" if holds_trained else "not loaded")
    return remaining


# --- the run spec's model section -----------------------------------------------------------------------------

@dataclass
class HandOff:
    """What crossed into the trainer for one MODEL: the spec's model section and, where the MODEL was described
    by files (not materialised), that description."""
    model_spec: object
    source: ModelSource | None = None
    materialised: bool = False
    notes: list = field(default_factory=list)


def hand_off_model(model: GraphModel, prompt: dict | None, node_id, input_name: str, models_root: Path,
                   resolve=_folder_file) -> HandOff:
    """The spec's model section for the MODEL on `input_name` of node `node_id`: described by its files where the
    graph allows, else materialised (one log line names the node that forced it). `resolve(folder, name)` finds a
    loader's file (ComfyUI's folder_paths by default)."""
    prediction = model.prediction
    link = input_link(prompt, node_id, input_name)
    try:
        source = describe_model(prompt, link, model, resolve)
    except Undescribable as exc:
        log.info("InGraph Trainer: the %s of node %s is materialised: %s", input_name, node_id, exc)
        path = materialise_model(model, models_root, prompt, link)
        source = ModelSource(str(path), "diffusion_model")
        return HandOff(source.model_spec(prediction), source, materialised=True)
    log.info("InGraph Trainer: the %s of node %s goes to the trainer as files: %s%s", input_name, node_id,
             Path(source.path).name, "".join(f" + {Path(p).name}@{s:g}" for p, s in source.loras))
    return HandOff(source.model_spec(prediction), source)


def hand_off_vae(vae, prompt: dict | None, node_id, models_root: Path, resolve=_folder_file) -> VaeSource:
    """The previews' VAE of Train node `node_id` (through its previews input's Sample Previews node)."""
    previews_link = input_link(prompt, node_id, "previews")
    link = input_link(prompt, previews_link[0], "vae") if previews_link else None
    try:
        return describe_vae(prompt, link, resolve)
    except Undescribable as exc:
        log.info("InGraph Trainer: the previews' VAE of node %s is materialised: %s", node_id, exc)
        return VaeSource(str(materialise_vae(vae, models_root, prompt, link)), "vae")
