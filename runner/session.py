"""One training run from the ComfyUI side: write the run directory, launch the trainer, watch it."""
from __future__ import annotations

import copy
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..cache.files import atomic_write_text
from ..cache.store import write_manifest
from ..trainer.spec import RunSpec, dump_run_spec
from ..trainer.run.trust import sign_run
from .launcher import TrainerProcess
from .runs import MANIFEST_FILE, SPEC_FILE, create_run_dir

log = logging.getLogger("ingraph_trainer")


class TrainingFailed(RuntimeError):
    """The trainer exited with an error; the message carries its error and the tail of its log."""


@dataclass
class RunResult:
    run_dir: Path
    adapter_path: str
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    finished: dict = field(default_factory=dict)


EVAL_MANIFEST_FILE = "eval_dataset.json"
PRIOR_MANIFEST_FILE = "prior_dataset.json"


# the longest path a run writes under its folder (a checkpoint being written, DeepSpeed's file names the longest)
DEEPEST_RUN_FILE = "checkpoints/.partial-step_000000-0123456789abcdef/fake_step10/bf16_zero_pp_rank_00_mp_rank_00_optim_states.pt"


@dataclass
class RunDatasets:
    """The cached datasets a run reads: its training images, and where given held-out ones (evaluation) and prior
    (regularisation) images mixed into every batch."""
    train: object
    eval: object = None
    prior: object = None


def prepare_run(draft: RunSpec, *, runs_root: Path, name: str, datasets: RunDatasets, cache_root: Path,
                lora_path: Path | None = None, previews=None, previews_vae=None, run_dir: Path | None = None,
                adjust: Callable[[RunSpec], RunSpec] | None = None) -> tuple[Path, Path]:
    """Creates the run directory with its dataset manifest(s) and run spec; returns (run dir, spec path).

    `draft` is the spec as the node built it (its task and settings, the model section of
    runner.model_source.hand_off_model); what only the runner knows is filled in here: the run folder, the
    datasets' manifests (and the training images' caption dropout), the previews' files (`previews`,
    runner.previews.PreviewSettings, needs `previews_vae`, runner.model_source.VaeSource), the output file and
    name. `run_dir`: this exact folder instead of a new one under runs_root. `adjust` (tools' --set overrides, which
    may name what the runner filled) changes the spec before it is validated and written.
    The spec and the manifests are signed with this installation's secret: only a signed run is ever resumed.
    The ComfyUI install the trainer imports is the launcher's (COMFYUI_PATH), never the spec's.
    """
    created = run_dir is None or not Path(run_dir).exists()  # only a folder made here is removed on failure
    if run_dir is None:
        run_dir = create_run_dir(runs_root, name)
    else:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _write_run(run_dir, copy.deepcopy(draft), name=name, datasets=datasets, cache_root=cache_root,
                          lora_path=lora_path, previews=previews, previews_vae=previews_vae, adjust=adjust)
    except BaseException:
        # a refused spec leaves no half-written run behind (the Train node's resume list would offer it)
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _write_run(run_dir: Path, spec: RunSpec, *, name, datasets: RunDatasets, cache_root, lora_path, previews,
               previews_vae, adjust) -> tuple[Path, Path]:
    from ..trainer.os_support import path_problem
    deepest = path_problem(run_dir / DEEPEST_RUN_FILE)
    if deepest:  # refused before anything is written, rather than a checkpoint failing mid-run
        raise ValueError(f"the run folder would be too deep for Windows ({deepest.split(' is ')[0]} is its "
                         "deepest file): install ComfyUI in a shorter folder, use a shorter output name, or enable "
                         "long paths in Windows")
    spec.run_dir = str(run_dir)
    spec.data.manifest = str(write_manifest(run_dir / MANIFEST_FILE, datasets.train, cache_root))
    spec.data.caption_dropout = float(getattr(datasets.train, "caption_dropout", 0.0))  # the trainer draws who sees ""
    signed = [SPEC_FILE, MANIFEST_FILE]
    if datasets.prior is not None:
        signed.append(PRIOR_MANIFEST_FILE)
        spec.data.prior_manifest = str(write_manifest(run_dir / PRIOR_MANIFEST_FILE, datasets.prior, cache_root))
    if datasets.eval is not None:
        signed.append(EVAL_MANIFEST_FILE)
        spec.data.eval_manifest = str(write_manifest(run_dir / EVAL_MANIFEST_FILE, datasets.eval, cache_root))
    if previews is not None:
        from .previews import write_preview_inputs
        spec.samples = write_preview_inputs(previews, run_dir, previews_vae)
    spec.output.lora_path = str(lora_path or "")
    spec.output.name = name
    if adjust is not None:
        spec = adjust(spec)
    spec.validate(str(run_dir / SPEC_FILE))
    spec_path = run_dir / SPEC_FILE
    atomic_write_text(spec_path, dump_run_spec(spec))
    sign_run(run_dir, signed)
    return run_dir, spec_path


def watch_run(process: TrainerProcess, on_event: Callable[[dict], None], check_interrupt: Callable[[], None],
              poll_s: float = 0.1) -> RunResult:
    """Relays events until the trainer exits. Any exception (an interrupt included) stops the whole run."""
    result = RunResult(run_dir=process.run_dir, adapter_path="")
    error_event = None

    def handle(events):
        nonlocal error_event
        for event in events:
            kind = event.get("type")
            # a diverged loss travels as null (events.json_safe): the chart leaves that point out
            if kind == "step" and isinstance(event.get("loss"), (int, float)):
                result.steps.append(int(event["step"]))
                result.losses.append(float(event["loss"]))
            elif kind == "eval" and isinstance(event.get("loss"), (int, float)):
                result.evals.append((int(event["step"]), float(event["loss"])))
            elif kind == "finished":
                result.finished = event
                result.adapter_path = event.get("adapter") or ""
            elif kind == "error":
                error_event = event
            elif kind == "started" and isinstance(event.get("memory_plan"), dict):
                log.info("InGraph Trainer: run %s: %s", process.run_dir.name, event["memory_plan"].get("summary"))
            elif kind == "log" and event.get("level") in ("warning", "error"):
                log.warning("InGraph Trainer: run %s: %s", process.run_dir.name, event.get("message"))
            on_event(event)

    try:
        while True:
            handle(process.poll_events())
            rc = process.poll()
            if rc is not None:
                handle(process.poll_events())
                break
            check_interrupt()
            time.sleep(poll_s)
    except BaseException:
        started = time.monotonic()
        process.terminate()
        log.info("InGraph Trainer: stopped run %s in %.2f s", process.run_dir.name, time.monotonic() - started)
        raise
    if rc != 0 or not result.finished:
        message = error_event.get("message") if error_event else f"trainer exited with code {rc}"
        for rank_file in sorted(process.run_dir.glob("error_rank*.txt")):  # failures of any rank
            lines = rank_file.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            if lines and not (error_event and rank_file.name == "error_rank0.txt"):
                message += f"\n{rank_file.stem.replace('error_', '')}: {lines[-1]}"
        # the log's lines stay in the file: what a process printed (DeepSpeed echoes its command and environment)
        # must not reach /history, which any client of the server can read
        raise TrainingFailed(f"Training failed ({process.run_dir.name}): {message}\n"
                             f"The trainer's full log: {process.log_path}")
    return result
