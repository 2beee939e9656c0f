"""Import ComfyUI's own model code into the trainer process (the ComfyUI install that launched it)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_COMFYUI_PATH = "/opt/ComfyUI"


def comfyui_path(configured: str = "") -> Path:
    path = Path(configured or os.environ.get("COMFYUI_PATH") or DEFAULT_COMFYUI_PATH)
    if not (path / "comfy" / "model_management.py").is_file():
        raise RuntimeError(f"ComfyUI not found at {path}: set model.comfyui_path in the run spec or COMFYUI_PATH")
    return path


def import_comfy(configured: str = ""):
    """Put ComfyUI on sys.path and configure it for this machine; returns the `comfy` package."""
    path = str(comfyui_path(configured))
    if path not in sys.path:
        sys.path.insert(0, path)
    import torch
    from comfy.cli_args import args
    if not torch.cuda.is_available():
        args.cpu = True  # must precede comfy.model_management's import on a machine without a GPU
    import comfy.model_management  # noqa: F401
    import comfy.sd  # noqa: F401
    import comfy
    return comfy
