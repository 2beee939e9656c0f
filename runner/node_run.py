"""The run of a node through the trainer program (Train LoRA: task "train"; Distill: "distill"; Evaluate:
"evaluate"): the node hands over its draft run spec (every setting its inputs give), and this fills only what the
runner owns: resume or a new run, the refusals before anything is written, the model's hand-off, the run folder,
launch, watch, and the input MODEL with the result applied (a task that writes an output file)."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ..trainer.spec import RunSpec, named_inputs
from .distill_run import check_new_distillation
from .evaluation_run import check_new_evaluation, remember_result, remembered_result
from .session import RunDatasets
from .train_run import TrainOutcome, check_new_training, refuse_foreign_file, timed

log = logging.getLogger("ingraph_trainer")


@dataclass(frozen=True)
class TaskRun:
    """What the runner does for one task beyond what every run does."""
    # the task's refusals of a new run beyond the spec's own rules: (draft, GraphModel, datasets, NodeCall) -> None or
    # ValueError
    check_new: Callable
    # an output file (an adapter, a model) that the output MODEL applies, resumable runs under runs/; else a result
    # only (Evaluate), in a folder of its own under evals/, never resumed
    writes_output: bool


TASK_RUNS = {"train": TaskRun(check_new_training, True), "distill": TaskRun(check_new_distillation, True),
             "evaluate": TaskRun(check_new_evaluation, False)}


@dataclass
class NodeCall:
    """The node a run serves: its title (errors name it), its id and the prompt (hidden inputs: where its MODEL
    and previews' VAE come from), `on_run(run id, steps)` giving the event handler, `check_interrupt`, and
    `inputs`, which of its inputs fills each spec field ("train.grad_accum": "gradient_accumulation")."""
    title: str
    node_id: str
    prompt: dict | None
    on_run: Callable[[str, int], Callable[[dict], None]]
    check_interrupt: Callable[[], None]
    inputs: dict = field(default_factory=dict)

    def refuse(self, problems: list[str]) -> None:
        """The spec's problems ("field: why") as this node's error, each naming its input where it has one."""
        if problems:
            raise ValueError(f"{self.title}: " + "; ".join(named_inputs(problems, self.inputs)))


def settings_problems(draft: RunSpec, datasets: RunDatasets) -> list[str]:
    """The spec's rules the node's settings break, asked before the model is handed off (which can take
    minutes): the draft with stand-ins for what only the runner fills (its folder, the files it writes)."""
    stand_in = dataclasses.replace(
        draft, run_dir="run", model=dataclasses.replace(draft.model, path="model.safetensors"),
        data=dataclasses.replace(draft.data, manifest="dataset.json",
                                 prior_manifest="prior.json" if datasets.prior is not None else "",
                                 eval_manifest="eval.json" if datasets.eval is not None else ""),
        output=dataclasses.replace(draft.output, lora_path="out.safetensors"))
    return stand_in.problems()


def run_task(draft: RunSpec, model, datasets: RunDatasets, previews, node: NodeCall, output_name: str = "",
             resume: str = "off", *, model_input: str = "model", remember: bool = False) -> TrainOutcome:
    """One node's run of `draft.task` (TASK_RUNS). A resumed run continues with the spec saved in its own folder
    (and must be of the same task); a new one is refused first by the spec's rules and its task's check_new, then
    its MODEL (the node's input `model_input`) is handed off (draft.model's base_precision kept) and its folder
    written (runner.session.prepare_run). `remember` (Evaluate's baseline): a result of this server for the same
    files, datasets and settings is given again without a run (runner.evaluation_run.remembered_result).
    The MODEL is asked about through one trainer-side view (trainer.graph_model.GraphModel), built here."""
    from . import paths
    from .launcher import TrainerProcess
    from ..trainer.graph_model import GraphModel
    from .model_source import (Undescribable, describe_model, hand_off_model, hand_off_vae, input_link,
                               record_trained_output, release_comfy_models, trained_output_source)
    from .run_record import trainer_running
    from .runs import SPEC_FILE, resolve_resume_choice, write_owner
    from .session import prepare_run, watch_run
    from ..trainer.spec import load_run_spec

    title, task, task_run = node.title, draft.task, TASK_RUNS[draft.task]
    graph_model = GraphModel(model)
    began = time.perf_counter()
    timings = {}  # what the node spends before the trainer starts, for the log (the hand-off's cost)
    if task_run.writes_output:
        lora_path, new_lora_name = paths.lora_output_path(output_name, paths.output_folder(draft.adapter.kind))
        name, runs_root = new_lora_name[: -len(".safetensors")], paths.runs_root
        resume_from = resolve_resume_choice(runs_root(), resume or "off", name, task)
    else:
        lora_path, name, runs_root, resume_from = None, "eval", paths.evals_root, None
    if resume_from is None and task_run.writes_output:
        refuse_foreign_file(lora_path, draft.output.overwrite, title, full=draft.adapter.kind == "full")
    elif resume_from is not None and trainer_running(resume_from[0]):  # two trainers would write one checkpoint
        raise ValueError(f"{title}: run {resume_from[0].name} is still training (queued elsewhere or "
                         "by another server); stop it before resuming it")
    if resume_from is not None:  # the run continues with the spec saved in its own directory
        run_dir, resume_tag = resume_from
        spec_path = run_dir / SPEC_FILE
        log.info("InGraph Trainer: resuming run %s from %s", run_dir.name, resume_tag)
        _, timings["releasing ComfyUI's models"] = timed(release_comfy_models, graph_model)
        try:  # the output MODEL is the live input plus the result: described as such where the graph allows
            input_source = describe_model(node.prompt, input_link(node.prompt, node.node_id, model_input),
                                          graph_model)
        except Undescribable:
            input_source = None
    else:
        if resume == "latest":
            log.info("InGraph Trainer: no checkpoint of %r to resume; starting a new run", name)
        resume_tag = None
        node.refuse(settings_problems(draft, datasets))
        try:  # the objective first: every refusal below reads the MODEL's family, which needs it
            _ = graph_model.prediction
        except ValueError as exc:  # an objective the trainer has not (EDM, image-to-image flow...)
            raise ValueError(f"{title}: {exc}") from None
        task_run.check_new(draft, graph_model, datasets, node)
        # the GPU goes to the trainer; and a fallback reads weights unpatched, as a loaded model may hold them patched
        _, timings["releasing ComfyUI's models"] = timed(release_comfy_models, graph_model)
        hand_off, timings["describing the model"] = timed(hand_off_model, graph_model, node.prompt, node.node_id,
                                                          model_input, paths.models_root())
        input_source = hand_off.source
        previews_vae = hand_off_vae(previews.vae, node.prompt, node.node_id, paths.models_root()) if previews else None
        draft = dataclasses.replace(draft, model=dataclasses.replace(
            hand_off.model_spec, base_precision=draft.model.base_precision))
        if remember and (known := remembered_result(draft, datasets)) is not None:
            return TrainOutcome(None, "", known)
        run_dir, spec_path = prepare_run(draft, runs_root=runs_root(), name=name, datasets=datasets,
                                         cache_root=paths.cache_root(), lora_path=lora_path, previews=previews,
                                         previews_vae=previews_vae)
    saved = load_run_spec(spec_path)  # what the trainer will run, for a new run and a resumed one alike
    if resume_from is not None:
        refuse_foreign_file(saved.output.lora_path, draft.output.overwrite or saved.output.overwrite, title,
                            full=saved.adapter.kind == "full")
    if task_run.writes_output:
        write_owner(run_dir, node.node_id)
    on_event = node.on_run(run_dir.name, saved.train.steps)
    # prime_beside (an evaluation): a Train node after an Evaluate node finds its standby warm
    process = TrainerProcess(run_dir, spec_path, comfyui_path=paths.comfyui_root(), resume=resume_tag,
                             processes=saved.distributed.processes, hostfile=saved.distributed.hostfile,
                             prime_beside=not task_run.writes_output).start()
    log.info("InGraph Trainer: run %s started (pid %d, %s) %.2f s after the node began (%s), log: %s", run_dir.name,
             process.pid, "a standby" if process.standby else "a new process", time.perf_counter() - began,
             ", ".join(f"{what} {seconds:.2f} s" for what, seconds in timings.items()), process.log_path)
    result = watch_run(process, on_event, node.check_interrupt)
    if not task_run.writes_output:
        if remember:
            remember_result(draft, datasets, result)
        return TrainOutcome(None, "", result)
    log.info("InGraph Trainer: run %s finished; written to %s%s", run_dir.name, result.adapter_path,
             f" (the file it replaced is kept as {result.finished['replaced_kept']})"
             if result.finished.get("replaced_kept") else "")
    lora_name = paths.lora_name_of(saved.output.lora_path, paths.output_folder(saved.adapter.kind))
    full = saved.adapter.kind == "full"
    trained = graph_model.with_result(result.adapter_path, saved.output.format, full=full)
    record_trained_output(node.node_id, trained, trained_output_source(result.adapter_path, input_source, full=full,
                                                                       file_format=saved.output.format))
    return TrainOutcome(trained.patcher, lora_name, result)
