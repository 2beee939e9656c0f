"""The Train node's work: resume or new run, checks, the model's hand-off, launch, watch, the trained MODEL."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..trainer.spec import AdapterSpec, DistributedSpec, TrainSpec

log = logging.getLogger("ingraph_trainer")


@dataclass
class TrainOutcome:
    model: object  # the input MODEL with the result applied
    lora_name: str  # as Load LoRA (or Load Diffusion Model) lists it
    result: object  # runner.session.RunResult


def check_family_settings(model, prediction: str, train, adapter, file_format: str, distributed=None,
                          title: str = "Train LoRA"):
    """Rejects, before anything is written, settings the MODEL's family cannot honour (the trainer checks again).
    `title`: the node the error names."""
    from ..trainer.spec import DistributedSpec, OutputSpec, RunSpec
    from ..trainer.models import UnsupportedSetting, family_for
    from .launcher import check_local_processes
    if distributed is not None and distributed.processes > 1 and not distributed.hostfile:
        try:
            check_local_processes(distributed.processes)
        except ValueError as exc:
            raise ValueError(f"{title}: {exc}") from None
    family = family_for(model.model, prediction=prediction)
    try:
        family.check_settings(RunSpec(train=train, adapter=adapter, output=OutputSpec(format=file_format),
                                      distributed=distributed or DistributedSpec()))
    except UnsupportedSetting as exc:
        raise ValueError(f"{title} ({family.display_name} model): {exc}") from None
    log.info("InGraph Trainer: %s on a %s model (%s)", title, family.display_name, prediction)


def check_prior_dataset(dataset, prior_dataset):
    """Refuses, before anything is written, prior images the trainer could not mix into the training batches."""
    from ..cache.dataset import prior_problems
    problems = prior_problems(dataset, prior_dataset)
    if dataset.caption_dropout > 0 and not prior_dataset.empty_text:  # dropout draws over every slot of a batch
        problems.append("prior_dataset: the training images' caption dropout gives prior images the empty caption "
                        "too, which the prior images' cache lacks; set the same caption_dropout on their Load "
                        "Training Images node (Cache Text Embeddings then caches the empty caption)")
    if problems:
        raise ValueError("Train LoRA: " + "; ".join(problems))


def refuse_foreign_file(path, overwrite: bool, title: str = "Train LoRA", full: bool = False):
    """A file the user put in models/ (no pack metadata) is replaced only when they say so (a copy is kept then:
    trainer/result.py keep_a_copy); a full fine-tune never replaces one (it could be any base model)."""
    from ..trainer.adapters import written_by_pack
    from .paths import lora_name_of
    path = Path(path)
    if not path.exists() or written_by_pack(path):
        return
    if full:
        raise ValueError(f"{title}: {lora_name_of(path, 'diffusion_models')} already exists and was not written by "
                         "InGraph Trainer; a full fine-tune never replaces such a file (overwrite applies to "
                         "adapters only): choose another output_name")
    if not overwrite:
        raise ValueError(f"{title}: {lora_name_of(path)} already exists and was not written by InGraph Trainer; "
                         "choose another output_name, or turn on overwrite to replace it (a copy is kept)")


def trained_model_of(model, path: str, file_format: str, full: bool):
    """The input MODEL with the result applied the way ComfyUI's loaders apply it (lazily: nothing loads now)."""
    from ..trainer.comfy_compat import load_tensors, with_lora
    from ..trainer.export import comfyui_readable, diffusers_module_names
    tensors = load_tensors(path)
    if full:  # every weight replaced; the MODEL's own options (sampling, patches on top) are kept
        trained = model.clone()
        trained.add_patches({f"diffusion_model.{k}": ("set", (v,)) for k, v in tensors.items()}, 1.0, 0.0)
        return trained
    if file_format == "diffusers":
        tensors = comfyui_readable(tensors, diffusers_module_names(model.model))
    return with_lora(model, tensors)


def timed(function, *args):
    """(what `function(*args)` returned, the seconds it took)."""
    t0 = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - t0


def with_output_weights(spec, weights: str):
    """output.weights (trained or ema), which prepare_run has no argument for."""
    spec.output.weights = weights
    return spec


def train_lora(model, dataset, *, adapter: AdapterSpec, train: TrainSpec, output_name: str, resume: str = "off",
               distributed: DistributedSpec | None = None, eval_dataset=None, previews=None,
               file_format: str = "comfyui", overwrite: bool = False, output_weights: str = "trained",
               prompt: dict | None = None, node_id: str = "", on_run: Callable[[str, int], Callable[[dict], None]],
               check_interrupt: Callable[[], None], prior_dataset=None, prior_weight: float = 1.0,
               prior_fraction: float = 0.5, base_precision: str = "as_loaded") -> TrainOutcome:
    """One Train node run. `on_run(run id, steps)` gives the event handler; `prompt` and `node_id` (the node's
    hidden inputs) say where its MODEL and previews VAE come from, so they reach the trainer as files.
    `prior_dataset`: prior (regularisation) images, `prior_fraction` of every batch, loss weight `prior_weight`.
    `base_precision` (spec.BASE_PRECISIONS): how the trainer holds the frozen base weights (fp8 halves bf16)."""
    def check_new_run(prediction: str):
        check_family_settings(model, prediction, train, adapter, file_format, distributed)
        if prior_dataset is not None:
            check_prior_dataset(dataset, prior_dataset)

    return run_trainer_node(model, dataset, task="train", title="Train LoRA", adapter=adapter, train=train,
                            output_name=output_name, resume=resume, distributed=distributed, previews=previews,
                            overwrite=overwrite, prompt=prompt, node_id=node_id, on_run=on_run,
                            check_interrupt=check_interrupt, base_precision=base_precision,
                            check_new_run=check_new_run,
                            prepare=dict(eval_dataset=eval_dataset, file_format=file_format,
                                         prior_dataset=prior_dataset, prior_weight=prior_weight,
                                         prior_fraction=prior_fraction),
                            adjust=lambda spec: with_output_weights(spec, output_weights))


def run_trainer_node(model, dataset, *, task: str, title: str, adapter: AdapterSpec, train: TrainSpec,
                     output_name: str, resume: str, distributed: DistributedSpec | None, previews, overwrite: bool,
                     prompt: dict | None, node_id: str, on_run: Callable[[str, int], Callable[[dict], None]],
                     check_interrupt: Callable[[], None], base_precision: str,
                     check_new_run: Callable[[str], None], prepare: dict,
                     adjust: Callable | None = None) -> TrainOutcome:
    """The run of a node that trains through the trainer program (Train LoRA: task "train"; Distill: "distill"):
    resume or a new run (`check_new_run(prediction)` refuses settings first; `prepare` and `adjust` go to
    session.prepare_run), the model's hand-off, launch, watch, and the input MODEL with the result applied.
    Errors name the node by `title`; a resumed run must be of the same `task`."""
    from . import paths
    from .launcher import TrainerProcess
    from .model_source import (Undescribable, describe_model, hand_off_model, hand_off_vae, input_link,
                               prediction_of, record_trained_output, release_comfy_models, trained_output_source)
    from .run_record import trainer_running
    from .runs import SPEC_FILE, resolve_resume_choice, write_owner
    from .session import prepare_run, watch_run
    from ..trainer.spec import load_run_spec

    began = time.perf_counter()
    timings = {}  # what the node spends before the trainer starts, for the log (the hand-off's cost)
    lora_path, new_lora_name = paths.lora_output_path(output_name, paths.output_folder(adapter.kind))
    name = new_lora_name[: -len(".safetensors")]
    resume_from = resolve_resume_choice(paths.runs_root(), resume or "off", name, task)
    if resume_from is None:
        refuse_foreign_file(lora_path, overwrite, title, full=adapter.kind == "full")
    elif trainer_running(resume_from[0]):  # two trainers would write the same checkpoints
        raise ValueError(f"{title}: run {resume_from[0].name} is still training (queued elsewhere or "
                         "by another server); stop it before resuming it")
    if resume_from is not None:  # the run continues with the spec saved in its own directory
        run_dir, resume_tag = resume_from
        spec_path = run_dir / SPEC_FILE
        log.info("InGraph Trainer: resuming run %s from %s", run_dir.name, resume_tag)
        _, timings["releasing ComfyUI's models"] = timed(release_comfy_models, model)
        try:  # the output MODEL is the live input plus the result: described as such where the graph allows
            input_source = describe_model(prompt, input_link(prompt, node_id, "model"), model)
        except Undescribable:
            input_source = None
    else:
        if resume == "latest":
            log.info("InGraph Trainer: no checkpoint of %r to resume; starting a new run", name)
        resume_tag = None
        check_new_run(prediction_of(model))
        # the GPU goes to the trainer; and a fallback reads weights unpatched, as a loaded model may hold them patched
        _, timings["releasing ComfyUI's models"] = timed(release_comfy_models, model)
        hand_off, timings["describing the model"] = timed(hand_off_model, model, prompt, node_id, "model",
                                                          paths.models_root())
        input_source = hand_off.source
        previews_vae = hand_off_vae(previews.vae, prompt, node_id, paths.models_root()) if previews else None
        model_spec = dataclasses.replace(hand_off.model_spec, base_precision=base_precision)
        run_dir, spec_path = prepare_run(runs_root=paths.runs_root(), name=name, model=model_spec,
                                         dataset=dataset, cache_root=paths.cache_root(), adapter=adapter,
                                         train=train, distributed=distributed, lora_path=lora_path, task=task,
                                         previews=previews, previews_vae=previews_vae, overwrite=overwrite,
                                         adjust=adjust, **prepare)
    saved = load_run_spec(spec_path)  # what the trainer will run, for a new run and a resumed one alike
    if resume_from is not None:
        refuse_foreign_file(saved.output.lora_path, overwrite or saved.output.overwrite, title,
                            full=saved.adapter.kind == "full")
    lora_name = paths.lora_name_of(saved.output.lora_path, paths.output_folder(saved.adapter.kind))
    write_owner(run_dir, node_id)
    on_event = on_run(run_dir.name, saved.train.steps)
    process = TrainerProcess(run_dir, spec_path, comfyui_path=paths.comfyui_root(), resume=resume_tag,
                             processes=saved.distributed.processes, hostfile=saved.distributed.hostfile).start()
    log.info("InGraph Trainer: run %s started (pid %d, %s) %.2f s after the node began (%s), log: %s", run_dir.name,
             process.pid, "a standby" if process.standby else "a new process", time.perf_counter() - began,
             ", ".join(f"{what} {seconds:.2f} s" for what, seconds in timings.items()), process.log_path)
    result = watch_run(process, on_event, check_interrupt)
    log.info("InGraph Trainer: run %s finished; written to %s%s", run_dir.name, result.adapter_path,
             f" (the file it replaced is kept as {result.finished['replaced_kept']})"
             if result.finished.get("replaced_kept") else "")

    full = saved.adapter.kind == "full"
    trained = trained_model_of(model, result.adapter_path, saved.output.format, full=full)
    record_trained_output(node_id, trained, trained_output_source(result.adapter_path, input_source, full=full,
                                                                  file_format=saved.output.format))
    return TrainOutcome(trained, lora_name, result)
