"""The Train node's own part of a run: its refusals before anything is written (runner.node_run.run_task asks
them)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ingraph_trainer")


@dataclass
class TrainOutcome:
    model: object  # the input MODEL with the result applied
    lora_name: str  # as Load LoRA (or Load Diffusion Model) lists it
    result: object  # runner.session.RunResult


def check_family_settings(model, train, adapter, file_format: str, distributed=None, title: str = "Train LoRA"):
    """Rejects, before anything is written, settings the MODEL's (a trainer.graph_model.GraphModel) family cannot
    honour (the trainer checks again). `title`: the node the error names."""
    from ..trainer.spec import DistributedSpec, OutputSpec, RunSpec
    from ..trainer.models import UnsupportedSetting
    from .launcher import check_local_processes
    if distributed is not None and distributed.processes > 1 and not distributed.hostfile:
        try:
            check_local_processes(distributed.processes)
        except ValueError as exc:
            raise ValueError(f"{title}: {exc}") from None
    try:
        family = model.family()
    except ValueError as exc:  # a model no family trains (an objective the trainer has not: EDM, ...)
        raise ValueError(f"{title}: {exc}") from None
    try:
        family.check_settings(RunSpec(train=train, adapter=adapter, output=OutputSpec(format=file_format),
                                      distributed=distributed or DistributedSpec()))
    except UnsupportedSetting as exc:
        raise ValueError(f"{title} ({family.display_name} model): {exc}") from None
    log.info("InGraph Trainer: %s on a %s model (%s)", title, family.display_name, model.prediction)


def check_dataset_for_model(model, dataset, title: str, where: str = "dataset"):
    """Refuses, before anything is handed off or launched, a dataset the MODEL's family cannot take (latents or
    captions cached with another model's VAE or text encoder, read from the first item's shard headers in the
    cache; reference images or sound it takes none of; item sizes it cannot run at): the trainer's rule
    (trainer.data.dataset_checks.check_dataset_for_family), naming the node's input (`where`)."""
    from ..trainer.data.dataset_checks import check_dataset_for_family
    from ..trainer.models import UnsupportedSetting
    from .paths import cache_root
    try:
        family = model.family()
    except ValueError as exc:  # a model no family takes (an objective the trainer has not: EDM, ...)
        raise ValueError(f"{title}: {exc}") from None
    try:
        check_dataset_for_family(dataset, family, where, cache_root())
    except UnsupportedSetting as exc:
        raise ValueError(f"{title} ({family.display_name} model): {exc}") from None


def check_prior_dataset(dataset, prior_dataset):
    """Refuses, before anything is written, prior images the trainer could not mix into the training batches."""
    from ..cache.dataset import prior_problems
    problems = prior_problems(dataset, prior_dataset)
    if problems:
        raise ValueError("Train LoRA: " + "; ".join(problems))


def refuse_foreign_file(path, overwrite: bool, title: str = "Train LoRA", full: bool = False):
    """A file the user put in models/ (no pack metadata) is replaced only when they say so (a copy is kept then:
    trainer/run/result.py keep_a_copy); a full fine-tune never replaces one (it could be any base model)."""
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


def timed(function, *args):
    """(what `function(*args)` returned, the seconds it took)."""
    t0 = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - t0


def check_new_training(draft, model, datasets, node):
    """A new Train LoRA run's refusals before anything is written: what the MODEL's family cannot honour (its
    settings; a dataset it cannot take: check_dataset_for_model), and prior images the trainer could not mix into
    the training batches."""
    check_family_settings(model, draft.train, draft.adapter, draft.output.format, draft.distributed, title=node.title)
    check_dataset_for_model(model, datasets.train, node.title)
    if datasets.eval is not None:
        check_dataset_for_model(model, datasets.eval, node.title, "eval_dataset")
    if datasets.prior is not None:
        check_prior_dataset(datasets.train, datasets.prior)
