"""The run spec: typed dataclasses loaded from TOML and validated once, with errors that name the field.

Both sides use this package: the Train node writes a spec, the trainer program reads it. It imports only the
standard library, so that loading it in the ComfyUI process costs nothing.
- choices.py: each setting's options, with the labels nodes show;
- sections.py: the spec's sections and the rules of each;
- run_spec.py: the whole spec and the rules across sections;
- toml_file.py: run.toml read and written.
"""
from __future__ import annotations

from .choices import (ADAPTER_FORMATS, ADAPTER_FORMAT_CHOICES, ADAPTER_KINDS, ADAPTER_KIND_CHOICES,
                      BASE_PRECISIONS, BASE_PRECISION_CHOICES, CHOICE_FIELDS, Choice, DEFAULT_EVAL_QUANTILES,
                      DEFAULT_EVAL_QUANTILES_TEXT, DISTILL_STUDENT_KINDS, LOSSES, LOSS_CHOICES, MEMORY_CHOICES,
                      MEMORY_MODES, MODEL_FORMATS, OPTIMIZERS, OPTIMIZER_CHOICES, OUTPUT_WEIGHTS,
                      OUTPUT_WEIGHTS_CHOICES, PRECISIONS, PRECISION_CHOICES, PREDICTIONS, SCHEDULES,
                      SCHEDULE_CHOICES, TARGET_CHOICES, TARGET_PRESETS, TASKS, TIMESTEP_SAMPLING,
                      TIMESTEP_SAMPLING_CHOICES, VAE_FORMATS, WEIGHT_DTYPES, choice_labels, choice_value,
                      choice_values, choices_tooltip, named_inputs)
from .run_spec import RunSpec, SPEC_VERSION
from .sections import (AdapterSpec, DataSpec, DistillSpec, DistributedSpec, MULTI_GPU_INSTALL, ModelSpec,
                       OutputSpec, RunSpecError, SampleSpec, TrainSpec, deepspeed_installed)
from .toml_file import dump_run_spec, load_run_spec, parse_run_spec, spec_from_dict

__all__ = ["ADAPTER_FORMATS", "ADAPTER_FORMAT_CHOICES", "ADAPTER_KINDS", "ADAPTER_KIND_CHOICES", "BASE_PRECISIONS",
           "BASE_PRECISION_CHOICES", "Choice", "DEFAULT_EVAL_QUANTILES", "DEFAULT_EVAL_QUANTILES_TEXT",
           "DISTILL_STUDENT_KINDS", "CHOICE_FIELDS", "LOSSES", "LOSS_CHOICES", "MEMORY_CHOICES", "MEMORY_MODES",
           "MODEL_FORMATS", "OPTIMIZERS", "OPTIMIZER_CHOICES", "OUTPUT_WEIGHTS", "OUTPUT_WEIGHTS_CHOICES",
           "PRECISIONS", "PRECISION_CHOICES", "PREDICTIONS", "SCHEDULES", "SCHEDULE_CHOICES",
           "TARGET_CHOICES", "TARGET_PRESETS", "TASKS", "TIMESTEP_SAMPLING", "TIMESTEP_SAMPLING_CHOICES",
           "VAE_FORMATS", "WEIGHT_DTYPES", "choice_labels", "choice_value", "choice_values",
           "choices_tooltip", "named_inputs", "RunSpec", "SPEC_VERSION", "AdapterSpec", "DataSpec", "DistillSpec",
           "DistributedSpec", "MULTI_GPU_INSTALL", "ModelSpec", "OutputSpec", "RunSpecError", "SampleSpec",
           "TrainSpec", "deepspeed_installed", "dump_run_spec", "load_run_spec", "parse_run_spec",
           "spec_from_dict"]
