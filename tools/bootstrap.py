"""Make the pack and ComfyUI importable in a tool or test process outside a ComfyUI server.

Puts the repo and ComfyUI on sys.path, registers the repo as the package `ingraph_trainer` (as ComfyUI and the
trainer see it), and runs ComfyUI on the CPU where there is no GPU. Every tool imports it from here (not from
another tool), so tools/ has no import cycle.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def bootstrap():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tools.comfy_server import comfyui_path
    # ComfyUI's folder leads: its top-level module `nodes` (which ComfyUI's own modules import) and the repo's
    # package `nodes/` share a name, so a repo put ahead of it since the last call must not win. Moved, not
    # added again: tools call this once per file they write.
    comfy = str(comfyui_path())
    if sys.path[0] != comfy:
        while comfy in sys.path:
            sys.path.remove(comfy)
        sys.path.insert(0, comfy)
    if "ingraph_trainer" not in sys.modules:
        package = types.ModuleType("ingraph_trainer")
        package.__path__ = [str(REPO)]
        sys.modules["ingraph_trainer"] = package
    from comfy.cli_args import args
    import torch
    if not torch.cuda.is_available():
        args.cpu = True
