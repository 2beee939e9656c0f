"""Run directories: where each run's spec, events, log, checkpoints and adapter live."""
from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
from ..trainer.layout import MANIFEST_FILE, SPEC_FILE  # noqa: F401


def valid_run_id(run_id: str) -> bool:
    return bool(RUN_ID_PATTERN.match(run_id)) and ".." not in run_id


def new_run_id(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:48] or "run"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{secrets.token_hex(2)}"


def create_run_dir(runs_root: str | Path, name: str) -> Path:
    root = Path(runs_root)
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(10):
        path = root / new_run_id(name)
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run directory in {root}")


def run_dir_for(runs_root: str | Path, run_id: str) -> Path | None:
    """The run's directory, or None for an invalid or unknown id; never resolves outside the root."""
    if not valid_run_id(run_id):
        return None
    root = Path(runs_root).resolve()
    path = (root / run_id).resolve()
    if path.parent != root or not path.is_dir():
        return None
    return path
