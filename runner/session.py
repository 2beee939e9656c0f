"""One training run from the ComfyUI side: write the run directory, launch the trainer, watch it."""
from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..cache.files import atomic_write_text
from ..cache.store import write_manifest
from ..trainer.spec import AdapterSpec, DistributedSpec, ModelSpec, RunSpec, TrainSpec, dump_run_spec
from ..trainer.trust import sign_run
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


def prepare_run(*, runs_root: Path, name: str, model: ModelSpec, dataset, cache_root: Path,
                adapter: AdapterSpec | None = None, train: TrainSpec, lora_path: Path | None = None,
                distributed: DistributedSpec | None = None, task: str = "train",
                eval_dataset=None, previews=None, previews_vae=None, prior_dataset=None,
                prior_weight: float = 1.0, prior_fraction: float = 0.5,
                file_format: str = "comfyui", overwrite: bool = False, run_dir: Path | None = None,
                adjust: Callable[[RunSpec], RunSpec] | None = None) -> tuple[Path, Path]:
    """Creates the run directory with its dataset manifest(s) and run spec; returns (run dir, spec path).

    `model` is the spec's model section (runner.model_source.hand_off_model). `previews`
    (runner.previews.PreviewSettings) needs `previews_vae` (runner.model_source.VaeSource), the file its VAE is
    read from. `prior_dataset`: prior (regularisation) images mixed into every batch at `prior_fraction` of its
    slots, their loss weighted by `prior_weight`; the dataset's caption dropout reaches the spec with it.
    `run_dir`: this exact folder instead of a new one under runs_root. `adjust` changes the spec
    before it is validated and written (tools/prepare_run.py's overrides).
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
        return _write_run(run_dir, name=name, model=model, dataset=dataset, cache_root=cache_root, adapter=adapter,
                          train=train, lora_path=lora_path, distributed=distributed, task=task,
                          eval_dataset=eval_dataset, previews=previews, previews_vae=previews_vae,
                          prior_dataset=prior_dataset, prior_weight=prior_weight, prior_fraction=prior_fraction,
                          file_format=file_format, overwrite=overwrite, adjust=adjust)
    except BaseException:
        # a refused spec leaves no half-written run behind (the Train node's resume list would offer it)
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _write_run(run_dir: Path, *, name, model, dataset, cache_root, adapter, train, lora_path, distributed, task,
               eval_dataset, previews, previews_vae, prior_dataset, prior_weight, prior_fraction, file_format,
               overwrite, adjust) -> tuple[Path, Path]:
    from ..trainer.os_support import path_problem
    deepest = path_problem(run_dir / DEEPEST_RUN_FILE)
    if deepest:  # refused before anything is written, rather than a checkpoint failing mid-run
        raise ValueError(f"the run folder would be too deep for Windows ({deepest.split(' is ')[0]} is its "
                         "deepest file): install ComfyUI in a shorter folder, use a shorter output name, or enable "
                         "long paths in Windows")
    manifest = write_manifest(run_dir / MANIFEST_FILE, dataset, cache_root)
    spec = RunSpec(task=task, run_dir=str(run_dir), model=dataclasses.replace(model),
                   adapter=dataclasses.replace(adapter or AdapterSpec()),
                   train=dataclasses.replace(train), distributed=dataclasses.replace(distributed or DistributedSpec()))
    spec.data.manifest = str(manifest)
    spec.data.caption_dropout = float(getattr(dataset, "caption_dropout", 0.0))  # the trainer draws who sees ""
    signed = [SPEC_FILE, MANIFEST_FILE]
    if prior_dataset is not None:
        signed.append(PRIOR_MANIFEST_FILE)
        spec.data.prior_manifest = str(write_manifest(run_dir / PRIOR_MANIFEST_FILE, prior_dataset, cache_root))
        spec.data.prior_weight, spec.data.prior_fraction = float(prior_weight), float(prior_fraction)
    if eval_dataset is not None:
        signed.append(EVAL_MANIFEST_FILE)
        spec.data.eval_manifest = str(write_manifest(run_dir / EVAL_MANIFEST_FILE, eval_dataset, cache_root))
    if previews is not None:
        from .previews import write_preview_inputs
        spec.samples = write_preview_inputs(previews, run_dir, previews_vae)
    spec.output.lora_path = str(lora_path or "")
    spec.output.name = name
    spec.output.format = file_format
    spec.output.overwrite = overwrite
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
