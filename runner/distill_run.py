"""The Distill node's work: DMD2 few-step distillation of the graph's MODEL (the frozen teacher) into a student
that trains as a LoRA (a "turbo LoRA" for the teacher) or in full, by the trainer program (task "distill",
trainer/tasks/distill.py). Resume, the model's hand-off, launch, watch and the output MODEL are the Train node's
(runner.node_run.run_task); only the settings and their checks are distillation's own."""
from __future__ import annotations

from ..trainer.spec import (ADAPTER_KIND_CHOICES, DISTILL_STUDENT_KINDS, AdapterSpec, DistillSpec, DistributedSpec,
                              RunSpec, TrainSpec)
from .train_run import check_family_settings

TITLE = "Distill"
TASK = "distill"


def check_student_adapter(adapter: AdapterSpec):
    """The adapter input: a LoRA or a full fine-tune (trainer.spec.DISTILL_STUDENT_KINDS: the other kinds make no
    turbo LoRA that ComfyUI users load, and the trainer refuses them)."""
    if adapter.kind not in DISTILL_STUDENT_KINDS:
        labels = {c.value: c.label for c in ADAPTER_KIND_CHOICES}
        kinds = " or ".join(labels[k] for k in DISTILL_STUDENT_KINDS)
        raise ValueError(f"{TITLE}: adapter: the student trains as {kinds}; the LoRA Adapter node's kind is "
                         f"{labels.get(adapter.kind, adapter.kind)}")
    if adapter.init_from:  # the student starts as the teacher (trainer/tasks/distill.py reads no adapter file)
        raise ValueError(f"{TITLE}: adapter: the student starts as a copy of the teacher, not from continue_from "
                         "(set it to none; to continue a distillation, use the resume input)")


def refuse(problems: list[str]):
    """The spec's problems (trainer.spec) as the node's error: its inputs carry the spec's field names without
    the table ("distill.fake_updates" -> fake_updates)."""
    if problems:
        raise ValueError(f"{TITLE}: " + "; ".join(p.removeprefix("distill.") for p in problems))


def parse_student_timesteps(text: str, student_steps: int) -> list[float]:
    """The student_timesteps input: '' (the levels KSampler's sgm_uniform visits), or numbers separated by commas
    or spaces ('1.0, 0.75, 0.5, 0.25') that the spec's rule (DistillSpec.problems) takes. The error names the
    input."""
    parts = [p for p in (text or "").replace(",", " ").split() if p]
    if not parts:
        return []
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{TITLE}: student_timesteps: {text!r} is not a list of numbers") from None
    spec = RunSpec(task=TASK, distill=DistillSpec(student_steps=student_steps, student_timesteps=values))
    refuse([p for p in spec.distill.problems(spec) if p.startswith("distill.student_timesteps:")])
    return values


def check_distill_settings(adapter: AdapterSpec, train: TrainSpec, distill: DistillSpec,
                           distributed: DistributedSpec | None):
    """Refuses, before anything is written, what the run spec would refuse (trainer.spec.DistillSpec.problems, and
    the run's block-swap rule): the error names the node's inputs."""
    check_student_adapter(adapter)
    spec = RunSpec(task=TASK, adapter=adapter, train=train, distributed=distributed or DistributedSpec(),
                   distill=distill)
    refuse(distill.problems(spec) + spec.block_swap_problems())


def check_guidance_caption(distill: DistillSpec, dataset):
    """The spec's rule for the teacher's guidance and the cached empty caption, on the node's DATASET."""
    problem = distill.guidance_caption_problem(bool(getattr(dataset, "empty_text", None)), "the dataset's cache")
    refuse([problem] if problem else [])


def check_new_distillation(draft: RunSpec, model, datasets, prediction: str, title: str = TITLE):
    """A new Distill run's refusals before anything is written: the student's kind, the spec's distillation rules,
    the teacher's guidance against the dataset's cache, and what the MODEL's family cannot honour."""
    check_distill_settings(draft.adapter, draft.train, draft.distill, draft.distributed)
    check_guidance_caption(draft.distill, datasets.train)
    check_family_settings(model, prediction, draft.train, draft.adapter, draft.output.format, draft.distributed,
                          title=title)
