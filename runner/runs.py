"""Run directories: where each run's spec, events, log, checkpoints and adapter live."""
from __future__ import annotations

import logging
import re
import secrets
import time
from pathlib import Path

from ..trainer.run.layout import MANIFEST_FILE, SPEC_FILE  # noqa: F401
from ..trainer.run.trust import run_is_trusted

log = logging.getLogger("ingraph_trainer")

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


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


def write_owner(run_dir: Path, node_id: str):
    import json
    from ..trainer.run.layout import OWNER_FILE
    (Path(run_dir) / OWNER_FILE).write_text(json.dumps({"node": str(node_id)}))


def _spec_fields(run_dir: Path) -> tuple[str | None, str | None]:
    """(output name, task) of a run's spec; a spec without a task is a training run, as the trainer reads it."""
    import tomllib
    try:
        spec = tomllib.loads((run_dir / SPEC_FILE).read_text(encoding="utf-8"))
        return spec.get("output", {}).get("name"), spec.get("task", "train")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None, None


def complete_checkpoints(run_dir: Path) -> list[str]:
    """Tags of the run's complete checkpoints, oldest first (the trainer's own definition of complete: a
    COMPLETE mark signed by this installation over exactly the files in the folder)."""
    from ..trainer.run.checkpoint import complete_checkpoints as complete
    return [path.name for path in complete(run_dir)]


def trusted_run(run_dir: Path) -> bool:
    """The run's spec and manifests are the ones this installation's runner wrote (trainer/run/trust.py)."""
    return run_is_trusted(run_dir, SPEC_FILE)


def resumable_checkpoints(runs_root: str | Path, limit: int = 50, task: str | None = None) -> list[str]:
    """'<run id>/<checkpoint>' for every complete checkpoint of a trusted run (of `task`, when given), newest run
    first."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    out = []
    for run_dir in sorted((p for p in root.iterdir() if p.is_dir()), reverse=True):
        if task is not None and _spec_fields(run_dir)[1] != task:
            continue
        tags = complete_checkpoints(run_dir)
        if tags and trusted_run(run_dir):
            out += [f"{run_dir.name}/{tag}" for tag in reversed(tags)]
        if len(out) >= limit:
            break
    return out[:limit]


def find_latest_resumable(runs_root: str | Path, output_name: str, task: str | None = None) -> tuple[Path, str] | None:
    """The newest trusted run of this output name (and task, when given: a Distill node never resumes a training
    run of the same name) that has a complete checkpoint: (run dir, checkpoint tag).
    Runs this installation did not write are skipped, with a log line."""
    root = Path(runs_root)
    if not root.is_dir():
        return None
    for run_dir in sorted((p for p in root.iterdir() if p.is_dir()), reverse=True):
        name, run_task = _spec_fields(run_dir)
        if name != output_name or (task is not None and run_task != task):
            continue
        if not trusted_run(run_dir):
            log.warning("InGraph Trainer: run %s is not signed by this installation; not resuming it", run_dir.name)
            continue
        tags = complete_checkpoints(run_dir)
        if tags:
            return run_dir, tags[-1]
    return None


def resolve_resume_choice(runs_root: str | Path, choice: str, output_name: str,
                          task: str | None = None) -> tuple[Path, str] | None:
    """Train node's resume input: 'off' → None; 'latest'; or '<run id>/<checkpoint>' (ValueError when that
    checkpoint is missing or incomplete, or its run was not written by this installation, or, `task` given, the
    run is another task's: a training run is not continued as a distillation, nor the other way round)."""
    if choice in ("", "off"):
        return None
    if choice == "latest":
        return find_latest_resumable(runs_root, output_name, task)
    run_id, _, tag = choice.partition("/")
    run_dir = run_dir_for(runs_root, run_id)
    if run_dir is None or tag not in complete_checkpoints(run_dir):
        raise ValueError(f"resume: checkpoint {choice!r} does not exist, is incomplete, or was not written by "
                         f"this installation")
    if not trusted_run(run_dir):
        raise ValueError(f"resume: run {run_id!r} was not written by this installation (its signature does not "
                         f"verify); refusing to resume it")
    run_task = _spec_fields(run_dir)[1]
    if task is not None and run_task != task:
        what = f"a {run_task} run" if run_task else "a run whose spec cannot be read"
        raise ValueError(f"resume: run {run_id!r} is {what}, not a {task} run; pick one of this node's own runs")
    return run_dir, tag
