"""The fallback for a MODEL (or VAE) whose patches no file describes: its patched weights written once under the
pack's data folder (ingraph_data/models, out of every client's reach), keyed by the upstream graph where the prompt
can stand for them (else by their content), reused while the graph is the same, and kept under a size cap, least
recently used removed first. model_source.py decides when a MODEL needs it."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("ingraph_trainer")

# materialised copies kept at most (bytes); the least recently used go first. INGRAPH_MATERIALISED_CAP_GB overrides.
DEFAULT_MATERIALISED_CAP_GB = 40.0


def materialised_cap_bytes() -> int:
    return int(float(os.environ.get("INGRAPH_MATERIALISED_CAP_GB") or DEFAULT_MATERIALISED_CAP_GB) * 2**30)


def graph_key(prompt: dict | None, link, what: str, state: dict) -> str | None:
    """A key for the weights at `link` without reading them: the upstream graph as the prompt gives it (class
    types, widget values, link structure), the size:mtime of every file its values name in ComfyUI's folders,
    and the names, shapes and dtypes of the tensors. None where the graph cannot stand for the weights: no prompt,
    or a Train node upstream whose output is not recorded (its result changes from run to run)."""
    if not isinstance(prompt, dict) or not (isinstance(link, list) and len(link) == 2):
        return None
    import folder_paths
    from ..trainer.models import file_stamp  # the trainer checks files by the same stamp
    seen, order, stack = {}, [], [str(link[0])]
    while stack:  # every node the value depends on, in a fixed order
        node_id = stack.pop()
        if node_id in seen:
            continue
        node = prompt.get(node_id)
        if not isinstance(node, dict) or node.get("class_type", "").startswith("InGraph"):
            return None
        seen[node_id] = len(seen)
        order.append(node_id)
        for value in node.get("inputs", {}).values():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int)):
                stack.append(str(value[0]))
    folders = list(folder_paths.folder_names_and_paths)
    described = []
    for node_id in order:
        node = prompt[node_id]
        inputs = {}
        for name, value in sorted(node.get("inputs", {}).items()):
            if isinstance(value, list) and len(value) == 2 and str(value[0]) in seen:
                inputs[name] = ["link", seen[str(value[0])], value[1]]
                continue
            inputs[name] = value
            if isinstance(value, str) and value:
                for folder in folders:
                    try:
                        path = folder_paths.get_full_path(folder, value)
                    except Exception:
                        path = None
                    if path and os.path.isfile(path):
                        inputs[f"{name}@{folder}"] = file_stamp(path)
        described.append({"class_type": node.get("class_type"), "inputs": inputs})
    shapes = [[k, list(v.shape), str(v.dtype)] for k, v in sorted(state.items())]
    blob = json.dumps({"what": what, "output": link[1], "nodes": described, "tensors": shapes},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def digest_state_dict(state_dict: dict) -> str:
    """Content hash of the weights: only where no graph can key them (see graph_key), since it reads every byte."""
    import torch
    h = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].to("cpu").contiguous()
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\n".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def materialise_model(model, root: str | Path, prompt: dict | None = None, link=None) -> Path:
    """The MODEL's (a trainer.graph_model.GraphModel) patched diffusion-model weights in a file ComfyUI's Load
    Diffusion Model builds the same model from: with the "config" metadata its detection needs beside the weights
    (LTX-2's sizes, Wan's variants)."""
    names = model.weight_shapes()  # names, shapes, dtypes (the patches change no shape)
    return materialise_state_dict(model.patched_state_dict, root, "diffusion model",
                                  graph_key(prompt, link, "model", names), model.config_metadata(names))


def materialise_vae(vae, root: str | Path, prompt: dict | None = None, link=None) -> Path:
    """The graph's VAE weights (ComfyUI keys, what comfy.sd.VAE reads) in a file keyed like a MODEL's. A TAE's
    latent width goes with them where its weights do not give it (ComfyUI 0.33's taef2 takes Flux.2's 128 packed
    channels into a 32-channel decoder; VAELoader tells its VAE so)."""
    state = vae.get_sd()
    metadata = {}
    decoder_in = state.get("taesd_decoder.1.weight")
    if decoder_in is not None and getattr(vae, "latent_channels", None) not in (None, decoder_in.shape[1]):
        metadata["tae_latent_channels"] = str(vae.latent_channels)
    return materialise_state_dict(lambda: state, root, "VAE", graph_key(prompt, link, "vae", state), metadata)


def materialise_state_dict(produce, root: str | Path, what: str, key: str | None = None,
                           metadata: dict[str, str] | None = None) -> Path:
    """The weights `produce()` returns, in root/<key>.safetensors (with `metadata` beside the key); produced only
    when no stored copy has the key."""
    state = None
    if key is None:
        log.info("InGraph Trainer: no graph keys the %s; hashing its weights to find a stored copy", what)
        state = produce()
        key = digest_state_dict(state)
    if metadata:  # a copy written without it (an older pack's) is another file, never reused for this one
        import hashlib
        import json
        key = hashlib.sha256(f"{key}|{json.dumps(metadata, sort_keys=True)}".encode()).hexdigest()
    root = Path(root)
    path = root / f"{key[:32]}.safetensors"
    if path.is_file():
        os.utime(path)  # used now: the last to be removed
        return path
    if state is None:
        state = produce()
    from safetensors.torch import save_file
    from ..cache.files import atomic_write
    root.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, prefix=".model-") as staged:  # fsynced: a reused copy is never a torn one
        save_file({k: v.to("cpu").contiguous() for k, v in state.items()}, str(staged.path),
                  metadata={**(metadata or {}), "key": key})
    log.info("InGraph Trainer: wrote the graph's %s to %s", what, path)
    evict_materialised(root, keep=path)
    return path


STALE_PARTIAL_S = 24 * 3600  # a temporary this old is no write in progress


def evict_materialised(root: str | Path, keep: Path, cap_bytes: int | None = None) -> list[Path]:
    """Removes the least recently used copies until the store fits its cap; never `keep` (about to be used)."""
    cap = materialised_cap_bytes() if cap_bytes is None else cap_bytes
    for partial in Path(root).glob(".model-*.partial"):  # left by a server killed while writing (as large as a model)
        try:
            if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
                partial.unlink()
        except FileNotFoundError:
            pass
    files = []
    for entry in Path(root).glob("*.safetensors"):
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        files.append((st.st_mtime_ns, st.st_size, entry))
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, entry in sorted(files):
        if total <= cap:
            break
        if entry == keep:
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            pass
        total -= size
        removed.append(entry)
        log.info("InGraph Trainer: removed the least recently used model copy %s (store over %.1f GB)",
                 entry.name, cap / 2**30)
    return removed
