"""The Distill node's work: DMD2 few-step distillation of the graph's MODEL (the frozen teacher) into a student
that trains as a LoRA (a "turbo LoRA" for the teacher) or in full, by the trainer program (task "distill",
trainer/tasks/distill.py). Resume, the model's hand-off, launch, watch and the output MODEL are the Train node's
(runner.node_run.run_task); only the settings and their checks are distillation's own."""
from __future__ import annotations

from ..trainer.spec import DistillSpec, RunSpec, named_inputs
from .train_run import check_dataset_for_model, check_family_settings

TITLE = "Distill"
TASK = "distill"


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
    problems = [p for p in spec.distill.problems(spec) if p.startswith("distill.student_timesteps:")]
    if problems:  # the Distill node's input of that name
        raise ValueError(f"{TITLE}: " + "; ".join(named_inputs(problems, {"distill.student_timesteps":
                                                                          "student_timesteps"})))
    return values


def check_new_distillation(draft: RunSpec, model, datasets, node):
    """A new Distill run's refusals beyond the spec's own rules (runner.node_run asks those of every task): the
    teacher's guidance against the dataset's cache, the clips' sound (not distilled yet), and what the MODEL's
    family cannot honour (its settings, the dataset's reference images)."""
    from ..trainer.data.dataset_checks import distillation_audio_problem
    problems = [draft.distill.guidance_caption_problem(bool(getattr(datasets.train, "empty_text", None)),
                                                       "the dataset's cache"),
                distillation_audio_problem(datasets.train, "dataset")]
    node.refuse([p for p in problems if p])
    check_family_settings(model, draft.train, draft.adapter, draft.output.format, draft.distributed, title=node.title)
    check_dataset_for_model(model, datasets.train, node.title)
