"""Import ComfyUI's own model code into the trainer process (the ComfyUI install that launched it).

The install comes from the launching server (COMFYUI_PATH, set by runner/launcher.py; default
/opt/ComfyUI), never from the run spec: a spec can be written by anyone who can write under output/,
and a path it named would be imported from.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_COMFYUI_PATH = "/opt/ComfyUI"


def comfyui_path() -> Path:
    path = Path(os.environ.get("COMFYUI_PATH") or DEFAULT_COMFYUI_PATH).resolve()
    if not (path / "comfy" / "model_management.py").is_file():
        raise RuntimeError(f"ComfyUI not found at {path}: set COMFYUI_PATH")
    return path


def import_comfy():
    """Put ComfyUI on sys.path and configure it for this machine; returns the `comfy` package."""
    path = comfyui_path()
    if str(path) not in sys.path:
        sys.path.append(str(path))  # last: nothing ComfyUI ships shadows the standard library or site-packages
    import torch
    from comfy.cli_args import args
    if not torch.cuda.is_available():
        args.cpu = True  # must precede comfy.model_management's import on a machine without a GPU
    import comfy.model_management  # noqa: F401
    import comfy.sd  # noqa: F401
    import comfy
    # `comfy` is a namespace package (no __init__.py): ask one of its modules where it came from
    where = Path(comfy.model_management.__file__).resolve().parent.parent
    if where != path:
        raise RuntimeError(f"`comfy` was imported from {where}, not from the ComfyUI at {path} (COMFYUI_PATH)")
    return comfy
