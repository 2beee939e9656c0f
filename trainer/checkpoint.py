"""Checkpoints: DeepSpeed's own files plus the trainer's state, marked complete only when all are written."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .layout import CHECKPOINTS_DIR

# torch is imported where it is used: the ComfyUI side reads checkpoint state through this module

COMPLETE_MARK = "COMPLETE"
STATE_FILE = "trainer_state.json"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARK).is_file() and (path / STATE_FILE).is_file()


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and is_complete(p))


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """'' → None; 'latest' → newest complete checkpoint (None when there is none); else that tag."""
    if not resume:
        return None
    done = complete_checkpoints(run_dir)
    if resume == "latest":
        return done[-1] if done else None
    path = checkpoints_dir(run_dir) / resume
    if path not in done:
        raise ValueError(f"checkpoint {resume!r} in {checkpoints_dir(run_dir)} is missing or incomplete")
    return path


def save_checkpoint(engine, run_dir: str | Path, step: int, state: dict, is_rank0: bool) -> Path:
    """`state` must be JSON-serialisable; random states travel in DeepSpeed's client state."""
    import torch
    root = checkpoints_dir(run_dir)
    tag = tag_for(step)
    engine.save_checkpoint(str(root), tag=tag, client_state={"trainer": state, "rng": rng_state()}, save_latest=False,
                           exclude_frozen_parameters=True)  # the base model is in the run spec already
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    path = root / tag
    if is_rank0:
        (path / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")
        mark = path / COMPLETE_MARK
        with open(mark, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return path


def load_checkpoint(engine, path: Path) -> dict:
    """Restores weights, optimizer, scheduler and random states; returns the trainer state."""
    _, client_state = engine.load_checkpoint(str(path.parent), tag=path.name,
                                             load_optimizer_states=True, load_lr_scheduler_states=True,
                                             load_module_strict=False)
    if client_state is None:
        raise ValueError(f"DeepSpeed could not load checkpoint {path}")
    set_rng_state(client_state["rng"])
    return client_state["trainer"]


def rng_state() -> dict:
    import torch
    return {"torch": torch.get_rng_state()}


def set_rng_state(state: dict):
    import torch
    torch.set_rng_state(state["torch"])
