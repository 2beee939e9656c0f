"""Checkpoints: DeepSpeed's own files plus the trainer's state, marked complete only when all are written.

DeepSpeed loads its files with pickle (torch.load(weights_only=False)), and any ComfyUI client can write
files under output/, so the COMPLETE mark lists the digest and size of every file of the checkpoint and
carries an HMAC made with this installation's secret (trainer/run/trust.py). A checkpoint is complete only if
its mark verifies and the folder holds exactly the files it lists; nothing is loaded before every file's
digest has been checked.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

from .layout import CHECKPOINTS_DIR, COMPLETE_MARK
from ..os_support import replace_file
from ...cache.files import fsync_dir
from ...cache.shards import file_sha256
from .trust import TrustError, read_signed_json, write_signed_json

# torch is imported where it is used: the ComfyUI side reads checkpoint state through this module

STATE_FILE = "trainer_state.json"
MARK_VERSION = 1
PARTIAL_PREFIX = ".partial-"  # a checkpoint being written, under a name no client can guess


class UntrustedCheckpoint(TrustError):
    """A checkpoint this installation did not write, or one changed after it was written."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def _step_of(path: Path) -> int:
    digits = path.name[len("step_"):]
    return int(digits) if digits.isdigit() else -1


def _folder_files(path: Path) -> dict[str, int]:
    """relative path → size of every file in the folder, the mark excepted; anything but plain files and
    folders (a symlink, a device) is refused."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            if full.is_symlink() or not (full.is_dir() or full.is_file()):
                raise UntrustedCheckpoint(f"checkpoint {path}: {full.relative_to(path)} is not a plain file")
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(path).as_posix()
            if rel != COMPLETE_MARK:
                files[rel] = (Path(dirpath) / name).stat().st_size
    return files


def write_mark(path: Path, step: int):
    """Signs what the folder holds now: run once every rank has written its files."""
    files = {rel: {"size": size, "sha256": file_sha256(path / rel)} for rel, size in sorted(_folder_files(path).items())}
    # bound to its run (the run folder's name, a unique id): a signed checkpoint copied into another run's folder
    # is not that run's
    write_signed_json(path / COMPLETE_MARK, {"version": MARK_VERSION, "step": step, "files": files,
                                             "run": _run_of(path)})


def _run_of(path: Path) -> str:
    """The run a checkpoint folder (<run>/checkpoints/<tag>) belongs to."""
    return Path(os.path.abspath(path)).parent.parent.name  # as named: a linked checkpoints folder is still the run's


def verify_checkpoint(path: Path, tag: str | None = None, digests: bool = True) -> dict:
    """The mark's contents; raises UntrustedCheckpoint naming the checkpoint unless the mark verifies, the folder
    holds exactly the files it lists (with their sizes) and, with `digests`, every file has its signed digest.
    `tag`: the name the checkpoint is used under (a mark copied to another step's folder does not verify)."""
    path = Path(path)
    try:
        mark = read_signed_json(path / COMPLETE_MARK)
    except (TrustError, OSError) as exc:
        raise UntrustedCheckpoint(f"checkpoint {path} is not trusted: {exc}") from None
    files = mark.get("files")
    step = mark.get("step")
    if mark.get("version") != MARK_VERSION or not isinstance(files, dict) or STATE_FILE not in files \
            or not all(isinstance(e, dict) for e in files.values()) or not isinstance(step, int) \
            or tag_for(step) != (tag or path.name):
        raise UntrustedCheckpoint(f"checkpoint {path}: its COMPLETE mark does not describe this checkpoint")
    # marks written before they named their run carry no "run" (the HMAC covers the body: none can be removed)
    if "run" in mark and mark["run"] != _run_of(path):
        raise UntrustedCheckpoint(f"checkpoint {path}: its COMPLETE mark was signed for run {mark['run']!r}, not "
                                  f"this run {_run_of(path)!r}")
    present = _folder_files(path)
    if present.keys() != files.keys():
        extra, missing = sorted(present.keys() - files.keys()), sorted(files.keys() - present.keys())
        raise UntrustedCheckpoint(f"checkpoint {path}: files differ from the signed list "
                                  f"(added: {extra[:5]}, missing: {missing[:5]})")
    for rel, entry in files.items():
        if present[rel] != entry.get("size"):
            raise UntrustedCheckpoint(f"checkpoint {path}: {rel} changed after it was signed (size)")
    if digests:
        for rel, entry in files.items():
            if file_sha256(path / rel) != entry.get("sha256"):
                raise UntrustedCheckpoint(f"checkpoint {path}: {rel} changed after it was signed")
    return mark


def is_complete(path: Path) -> bool:
    """Cheap: the mark's HMAC and the folder's file list and sizes (load_checkpoint checks every digest)."""
    try:
        verify_checkpoint(path, digests=False)
        return True
    except (UntrustedCheckpoint, OSError, ValueError, TypeError, RecursionError):
        return False


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoints_dir(run_dir)
    if not root.is_dir() or root.is_symlink():
        return []
    found = [p for p in root.iterdir()
             if p.name.startswith("step_") and p.is_dir() and not p.is_symlink() and is_complete(p)]
    return sorted(found, key=_step_of)  # by step: step_1000000 comes after step_999999


def _on_rank0(compute):
    """Runs `compute` on rank 0 only and hands every rank its result (or its error message): the secret
    need only be on the launching machine, and all ranks take the same decision."""
    import torch
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank0 = not distributed or torch.distributed.get_rank() == 0
    verdict = [None, None]
    if rank0:
        try:
            verdict = [compute(), None]
        except (ValueError, OSError, RecursionError) as exc:
            verdict = [None, str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"]
    if distributed:
        torch.distributed.broadcast_object_list(verdict, src=0)
    if verdict[1] is not None:
        raise UntrustedCheckpoint(verdict[1])
    return verdict[0]


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """'' → None; 'latest' → newest complete checkpoint (None when there is none); else that tag.
    Collective under torch.distributed: rank 0 decides."""
    if not resume:
        return None

    def choose():
        done = complete_checkpoints(run_dir)
        if resume == "latest":
            return done[-1].name if done else None
        if checkpoints_dir(run_dir) / resume not in done:
            raise ValueError(f"checkpoint {resume!r} in {checkpoints_dir(run_dir)} is missing, incomplete, or "
                             f"not written by this installation")
        return resume
    tag = _on_rank0(choose)
    return None if tag is None else checkpoints_dir(run_dir) / tag


def save_checkpoint(engine, run_dir: str | Path, step: int, state: dict, is_rank0: bool, keep_last: int = 0,
                    components: dict | None = None) -> Path:
    """`state` must be JSON-serialisable; random states travel in DeepSpeed's client state, and so do the
    `components` (name → object with state_dict(); the same on every rank, such as the EMA).

    Every rank writes under a fresh random name (no client can plant files there before the mark signs
    them), then rank 0 signs the folder and moves it to its step's name. A tag saved again (a resumed run)
    loses its COMPLETE mark before anything is written. `keep_last` > 0: rank 0 then removes the oldest
    complete checkpoints beyond that many, never the one just written."""
    import torch
    distributed = torch.distributed.is_initialized()

    def barrier():
        if distributed:
            torch.distributed.barrier()

    root = checkpoints_dir(run_dir)
    tag = tag_for(step)
    path = root / tag
    partial = [f"{PARTIAL_PREFIX}{tag}-{secrets.token_hex(8)}"]
    if is_rank0:
        root.mkdir(parents=True, exist_ok=True)
        (path / COMPLETE_MARK).unlink(missing_ok=True)
        for leftover in root.glob(f"{PARTIAL_PREFIX}*"):  # of a save that was killed
            _remove(leftover)
    if distributed:
        torch.distributed.broadcast_object_list(partial, src=0)
    barrier()
    engine.save_checkpoint(str(root), tag=partial[0], client_state={"trainer": state, "rng": rng_state(),
                                                              **{name: c.state_dict()
                                                                 for name, c in (components or {}).items()}},
                           # the base model is in the run spec (and block swap's weights, set aside while the
                           # engine started, must stay out of DeepSpeed's frozen-parameter bookkeeping)
                           save_latest=False, exclude_frozen_parameters=True)
    barrier()
    if is_rank0:
        written = root / partial[0]
        (written / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")
        write_mark(written, step)
        if path.exists() or path.is_symlink():
            _remove(path)
        replace_file(written, path)
        fsync_dir(root)
        if keep_last > 0:
            prune_checkpoints(run_dir, keep_last, keep=path)
    barrier()
    return path


def prune_checkpoints(run_dir: str | Path, keep_last: int, keep: Path | None = None) -> list[Path]:
    """Removes the oldest complete checkpoints beyond the newest `keep_last` (never `keep`); returns them."""
    done = complete_checkpoints(run_dir)
    removed = [p for p in done[: max(0, len(done) - keep_last)] if p != keep]
    for p in removed:
        _remove(p)
    return removed


def _remove(path: Path):
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path)


def _copy_verified(path: Path, files: dict, into: Path) -> str | None:
    """Copies the signed files to `into`, hashing the bytes copied; the reason if any differs, else None."""
    import hashlib
    for rel, entry in files.items():
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        with open(path / rel, "rb") as src, open(target, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
                dst.write(block)
        if h.hexdigest() != entry.get("sha256"):
            return f"checkpoint {path}: {rel} changed after it was signed"
    return None


def _every_rank_agrees(problem: str | None) -> str | None:
    """The first rank's problem, on every rank (so none goes on to a collective the others skip)."""
    import torch
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return problem
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, problem)
    return next((p for p in gathered if p), None)


def load_checkpoint(engine, path: Path, components: dict | None = None) -> dict:
    """Restores weights, optimizer, scheduler and random states, and each of `components` (load_state_dict(state,
    where)) from what it saved; returns the trainer state.

    Rank 0 checks the signed mark; then every rank copies the listed files into a private temporary folder
    (outside output/, which any client can write), checking each byte copied against the signed digests,
    and DeepSpeed unpickles those copies: a file swapped in after the check is never what gets loaded."""
    import tempfile
    path = Path(path)
    mark = _on_rank0(lambda: verify_checkpoint(path, digests=False))
    with tempfile.TemporaryDirectory(prefix="ingraph-resume-") as private:
        copy = Path(private) / path.name
        copy.mkdir()
        try:
            problem = _copy_verified(path, mark["files"], copy)
        except OSError as exc:
            problem = f"checkpoint {path} cannot be read ({type(exc).__name__})"
        problem = _every_rank_agrees(problem)
        if problem:
            raise UntrustedCheckpoint(problem)
        _, client_state = engine.load_checkpoint(str(copy.parent), tag=copy.name,
                                                 load_optimizer_states=True, load_lr_scheduler_states=True,
                                                 load_module_strict=False)
    if client_state is None:
        raise ValueError(f"DeepSpeed could not load checkpoint {path}")
    set_rng_state(client_state["rng"])
    for name, component in (components or {}).items():
        if name not in client_state:  # it could not resume exactly: refused rather than restarted
            raise ValueError(f"checkpoint {path} was saved without its {name} state; resume it with the "
                             f"settings it was trained with, or start a new run")
        component.load_state_dict(client_state[name], f"checkpoint {path}")
    return client_state["trainer"]


def rng_state() -> dict:
    """Every generator a step draws from: the CPU's, and this process's CUDA device's where it computes on one
    (dropout, rank dropout and noise made on the device draw from it)."""
    import torch
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's: each rank sets its own before any step
    return state


def set_rng_state(state: dict):
    """Restores rng_state()'s generators; a checkpoint saved on a CPU (or before the device's generator was
    saved) restores the CPU's alone."""
    import torch
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """The run's checkpointing, as one component (torchtitan's CheckpointManager): where a run resumes from, and
    which steps save. The layout saves and loads (DeepSpeed's files for its stages); this decides when."""

    def __init__(self, layout, run_dir: str | Path, save_every: int, keep_last: int, is_rank0: bool,
                 components: dict | None = None):
        self.layout, self.run_dir = layout, Path(run_dir)
        self.save_every, self.keep_last, self.is_rank0 = save_every, keep_last, is_rank0
        # state saved and resumed beside DeepSpeed's (name → state_dict()/load_state_dict(state, where)), None: off
        self.components = {name: c for name, c in (components or {}).items() if c is not None}

    def resume(self, resume: str) -> tuple[int, Path | None]:
        """(the step to start from, the checkpoint it was restored from). Collective."""
        path = resolve_resume(self.run_dir, resume)
        if path is None:
            return 0, None
        return int(self.layout.load(path, self.components)["step"]), path

    def due(self, step: int, total: int, stop_requested: bool) -> bool:
        """The last step is not saved: the run's result is written instead."""
        return step < total and (bool(self.save_every and step % self.save_every == 0) or stop_requested)

    def save(self, step: int, state: dict) -> Path:
        return self.layout.save(self.run_dir, step, state, self.is_rank0, self.keep_last, self.components)
