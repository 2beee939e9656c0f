"""Hand the graph's MODEL to the trainer exactly as the graph has it (upstream patches included).

A MODEL does not record its source file, so its patched diffusion-model weights are written once
to a content-addressed file; later runs on the same weights reuse it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger("ingraph_trainer")


def prediction_of(model) -> str:
    """The objective the MODEL is configured for (a ModelSamplingDiscrete node upstream included)."""
    from ..trainer.models import prediction_from_sampling
    return prediction_from_sampling(model.get_model_object("model_sampling"))


def patched_state_dict(model) -> dict:
    import comfy.model_management
    comfy.model_management.load_models_gpu([model], force_patch_weights=True, force_full_load=True)
    return {k: v.detach() for k, v in model.model.diffusion_model.state_dict().items()}


def digest_state_dict(state_dict: dict) -> str:
    import torch
    h = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].to("cpu").contiguous()
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\n".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def materialise_model(model, root: str | Path) -> Path:
    return materialise_state_dict(patched_state_dict(model), root, "diffusion model")


def materialise_vae(vae, root: str | Path) -> Path:
    """The graph's VAE weights (ComfyUI keys, what comfy.sd.VAE reads) in a content-addressed file."""
    return materialise_state_dict(vae.get_sd(), root, "VAE")


def materialise_state_dict(state: dict, root: str | Path, what: str) -> Path:
    digest = digest_state_dict(state)
    root = Path(root)
    path = root / f"{digest[:32]}.safetensors"
    if path.is_file():
        return path
    from safetensors.torch import save_file
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".model-", suffix=".partial")
    os.close(fd)
    try:
        save_file({k: v.to("cpu").contiguous() for k, v in state.items()}, tmp, metadata={"sha256": digest})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    log.info("InGraph Trainer: wrote the graph's %s to %s", what, path)
    return path
