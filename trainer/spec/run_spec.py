"""The whole run spec and the rules across its sections, checked once (RunSpec.validate): every problem found is
reported together, each naming its field."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..optim import optimizer_named
from .choices import (ADAPTER_FORMATS, ADAPTER_KINDS, BASE_PRECISIONS, LOSSES, MEMORY_MODES, MODEL_FORMATS,
                      OPTIMIZERS, OUTPUT_WEIGHTS, PRECISIONS, PREDICTIONS, SCHEDULES, TARGET_PRESETS, TASKS,
                      TIMESTEP_SAMPLING, VAE_FORMATS, WEIGHT_DTYPES)
from .sections import (AdapterSpec, DataSpec, DistillSpec, DistributedSpec, ModelSpec, OutputSpec, RunSpecError,
                       SampleSpec, TrainSpec)

SPEC_VERSION = 1


@dataclass
class RunSpec:
    version: int = SPEC_VERSION
    task: str = "train"  # or "evaluate": held-out loss of the model as given, nothing trained
    run_dir: str = ""
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    adapter: AdapterSpec = field(default_factory=AdapterSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    distributed: DistributedSpec = field(default_factory=DistributedSpec)
    samples: SampleSpec = field(default_factory=SampleSpec)
    distill: DistillSpec = field(default_factory=DistillSpec)

    def validate(self, source: str = "run spec") -> "RunSpec":
        problems = self.problems()
        if problems:
            raise RunSpecError(f"{source}: " + "; ".join(problems))
        return self

    def problems(self) -> list[str]:
        """Every rule of the spec it breaks, each "field: why" (the field dotted: train.optimizer)."""
        problems = []

        def need(ok: bool, where: str, msg: str):
            if not ok:
                problems.append(f"{where}: {msg}")

        t, a = self.train, self.adapter
        need(self.version == SPEC_VERSION, "version", f"must be {SPEC_VERSION} (got {self.version})")
        need(self.task in TASKS, "task", f"must be one of {TASKS} (got {self.task!r})")
        need(bool(self.run_dir), "run_dir", "is required")
        need(bool(self.model.path), "model.path", "is required")
        need(self.model.prediction in PREDICTIONS, "model.prediction", f"must be one of {PREDICTIONS}")
        m = self.model
        need(m.format in MODEL_FORMATS, "model.format", f"must be one of {MODEL_FORMATS} (got {m.format!r})")
        need(m.weight_dtype in WEIGHT_DTYPES, "model.weight_dtype",
             f"must be one of {WEIGHT_DTYPES} (got {m.weight_dtype!r})")
        need(m.base_precision in BASE_PRECISIONS, "model.base_precision",
             f"must be one of {BASE_PRECISIONS} (got {m.base_precision!r})")
        need(len(m.lora_paths) == len(m.lora_strengths), "model.lora_strengths",
             f"needs one strength per model.lora_paths entry ({len(m.lora_strengths)} for {len(m.lora_paths)})")
        need(all(isinstance(p, str) and p for p in m.lora_paths), "model.lora_paths", "must be a list of file paths")
        need(all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                 for v in m.lora_strengths), "model.lora_strengths", "must be a list of finite numbers")
        need(not m.stamps or len(m.stamps) == 1 + len(m.lora_paths), "model.stamps",
             "needs one \"size:mtime_ns\" entry for model.path and one per LoRA, or none")
        need(not (a.kind == "full" and (m.base_precision == "fp8" or m.weight_dtype.startswith("fp8"))),
             "model.base_precision", "a full fine-tune trains every base weight, which fp8 cannot hold; load the "
             "model in its own precision (weight_dtype default, base_precision as_loaded)")
        need(self.samples.vae_format in VAE_FORMATS, "samples.vae_format",
             f"must be one of {VAE_FORMATS} (got {self.samples.vae_format!r})")
        need(bool(self.data.manifest), "data.manifest", "is required")
        dd = self.data
        need(0.0 <= dd.caption_dropout < 1.0, "data.caption_dropout", f"must be in [0, 1) (got {dd.caption_dropout})")
        need(dd.prior_weight >= 0, "data.prior_weight", f"must be 0 or more (got {dd.prior_weight})")
        need(0.0 < dd.prior_fraction < 1.0, "data.prior_fraction", f"must be in (0, 1) (got {dd.prior_fraction})")
        need(not dd.prior_manifest or dd.prior_manifest != dd.manifest, "data.prior_manifest",
             "is the training manifest itself; give the prior (regularisation) images' manifest")
        need(not dd.prior_manifest or self.distributed.pipeline_stages <= 1, "data.prior_manifest",
             "prior images are not available with pipeline stages (distributed.pipeline_stages > 1); train with "
             "1 stage, or without prior images")
        need(a.kind in ADAPTER_KINDS, "adapter.kind", f"must be one of {ADAPTER_KINDS} (got {a.kind!r})")
        need(not a.init_from or Path(a.init_from).is_file(), "adapter.init_from", f"{a.init_from} does not exist")
        need(not (a.init_from and a.kind == "full"), "adapter.init_from",
             "a full fine-tune starts from the graph's MODEL (load the fine-tuned model there instead)")
        need(a.rank >= 1, "adapter.rank", f"must be at least 1 (got {a.rank})")
        need(a.alpha > 0 and math.isfinite(a.alpha), "adapter.alpha", f"must be a positive number (got {a.alpha})")
        need(0.0 <= a.dropout < 1.0, "adapter.dropout", f"must be in [0, 1) (got {a.dropout})")
        need(a.targets in TARGET_PRESETS, "adapter.targets", f"must be one of {TARGET_PRESETS} (got {a.targets!r})")
        need(not (a.kind == "dora" and a.targets == "all_layers"), "adapter.targets",
             "DoRA trains linear layers only (its magnitude is per output row of a matrix); choose all linear "
             "layers, or LoRA, LoHa or LoKr for convolutions too")
        need(t.steps >= 1, "train.steps", f"must be at least 1 (got {t.steps})")
        need(t.batch_size >= 1, "train.batch_size", f"must be at least 1 (got {t.batch_size})")
        need(t.grad_accum >= 1, "train.grad_accum", f"must be at least 1 (got {t.grad_accum})")
        need(t.learning_rate > 0, "train.learning_rate", f"must be positive (got {t.learning_rate})")
        need(t.optimizer in OPTIMIZERS, "train.optimizer", f"must be one of {OPTIMIZERS} (got {t.optimizer!r})")
        need(t.lr_schedule in SCHEDULES, "train.lr_schedule", f"must be one of {SCHEDULES} (got {t.lr_schedule!r})")
        need(t.weight_decay >= 0, "train.weight_decay", f"must be 0 or more (got {t.weight_decay})")
        need(t.max_grad_norm >= 0, "train.max_grad_norm", f"must be 0 (off) or more (got {t.max_grad_norm})")
        need(t.seed >= 0, "train.seed", f"must be 0 or more (got {t.seed})")
        need(t.warmup_steps >= 0, "train.warmup_steps", f"must be 0 or more (got {t.warmup_steps})")
        need(t.loss in LOSSES, "train.loss", f"must be one of {LOSSES} (got {t.loss!r})")
        need(t.huber_delta > 0, "train.huber_delta", f"must be positive (got {t.huber_delta})")
        need(t.min_snr_gamma >= 0, "train.min_snr_gamma", f"must be 0 (off) or positive (got {t.min_snr_gamma})")
        need(t.timestep_sampling in TIMESTEP_SAMPLING, "train.timestep_sampling",
             f"must be one of {TIMESTEP_SAMPLING} (got {t.timestep_sampling!r})")
        need(t.logit_std > 0, "train.logit_std", f"must be positive (got {t.logit_std})")
        need(t.flow_shift > 0 and math.isfinite(t.flow_shift), "train.flow_shift",
             f"must be a positive number (got {t.flow_shift})")
        need(t.guidance >= 0, "train.guidance", f"must be 0 or more (got {t.guidance})")
        need(t.precision in PRECISIONS, "train.precision", f"must be one of {PRECISIONS} (got {t.precision!r})")
        need(t.memory in MEMORY_MODES, "train.memory", f"must be one of {MEMORY_MODES} (got {t.memory!r})")
        need(t.memory_budget_gb >= 0 and math.isfinite(t.memory_budget_gb), "train.memory_budget_gb",
             f"must be 0 (the device's free memory) or more (got {t.memory_budget_gb})")
        need(t.save_every >= 0, "train.save_every", f"must be 0 or more (got {t.save_every})")
        need(t.keep_last >= 0, "train.keep_last", f"must be 0 (keep all) or more (got {t.keep_last})")
        for where, weights in (("model.path", self.model.path), ("adapter.init_from", a.init_from),
                               ("samples.conditioning", self.samples.conditioning),
                               ("samples.vae_path", self.samples.vae_path),
                               *(("model.lora_paths", p) for p in m.lora_paths if isinstance(p, str))):
            # other weight formats load through pickle, which runs code: refuse them before anything loads
            need(not weights or weights.lower().endswith(".safetensors"), where,
                 f"must be a .safetensors file (got {Path(weights).name!r})")
        need(t.eval_every >= 0, "train.eval_every", f"must be 0 or more (got {t.eval_every})")
        need(isinstance(t.eval_quantiles, list) and (bool(t.eval_quantiles) or self.task != "evaluate")
             and all(isinstance(q, (int, float)) and 0.0 < q < 1.0 for q in t.eval_quantiles),
             "train.eval_quantiles", "must be a list of values in (0, 1) (empty: no evaluation)")
        need(isinstance(t.eval_items, int) and t.eval_items >= 0, "train.eval_items",
             f"must be 0 (no evaluation) or more (got {t.eval_items!r})")
        need(self.task == "evaluate" or bool(self.output.lora_path), "output.lora_path", "is required")
        need(self.output.format in ADAPTER_FORMATS, "output.format",
             f"must be one of {ADAPTER_FORMATS} (got {self.output.format!r})")
        need(a.kind != "full" or self.output.format == "comfyui", "output.format",
             "a full fine-tune is saved as a diffusion-model file with ComfyUI keys (format 'comfyui')")
        need(self.output.format != "diffusers" or a.kind in ("lora", "full"), "output.format",
             f"the diffusers format holds plain LoRA only (adapter.kind is {a.kind!r}); use comfyui or kohya")
        s = self.samples
        need(s.every >= 0, "samples.every", f"must be 0 or more (got {s.every})")
        need(all(isinstance(p, str) for p in s.prompts), "samples.prompts", "must be a list of strings")
        need(s.cfg >= 0, "samples.cfg", f"must be 0 or more (got {s.cfg})")
        need(s.seed >= 0, "samples.seed", f"must be 0 or more (got {s.seed})")
        if s.every:
            need(bool(s.conditioning), "samples.conditioning", "is required when samples.every > 0")
            need(bool(s.vae_path), "samples.vae_path", "is required when samples.every > 0")
            need(bool(s.prompts), "samples.prompts", "needs at least one prompt")
            need(s.steps >= 1, "samples.steps", f"must be at least 1 (got {s.steps})")
            need(s.width >= 8 and s.width % 8 == 0 and s.height >= 8 and s.height % 8 == 0, "samples.width/height",
                 f"must be multiples of 8 (got {s.width}x{s.height})")
        d = self.distributed
        problems += d.problems()
        need(0.0 <= t.ema_decay < 1.0, "train.ema_decay", f"must be in [0, 1) (got {t.ema_decay})")
        need(t.ema_start_step >= 0, "train.ema_start_step", f"must be 0 or more (got {t.ema_start_step})")
        need(self.output.weights in OUTPUT_WEIGHTS, "output.weights",
             f"must be one of {OUTPUT_WEIGHTS} (got {self.output.weights!r})")
        need(self.output.weights != "ema" or t.ema_decay > 0, "output.weights",
             "'ema' needs the average kept: set train.ema_decay above 0")
        # the average is of whole weights on every process; these layouts hold slices of them
        need(not t.ema_decay or d.zero_stage < 3, "train.ema_decay",
             "ZeRO-3 (distributed.zero_stage 3) partitions the weights across processes; use stage 0-2 with EMA")
        need(not t.ema_decay or d.pipeline_stages <= 1, "train.ema_decay",
             "pipeline stages (distributed.pipeline_stages) hold a share of the layers each; EMA needs one stage")
        # what DeepSpeed's wrappers would change for this optimizer (its record's flags); one process without
        # DeepSpeed (plain_engine) hands it fp32 master copies of the weights' own shapes
        o = optimizer_named(t.optimizer)
        need(o is None or not o.factored or (d.zero_stage == 0 and (t.precision == "fp32" or not d.needs_deepspeed)),
             "train.optimizer", f"{t.optimizer} factors the second moment of each weight matrix, but DeepSpeed "
             f"hands it flattened 1-D copies under ZeRO (distributed.zero_stage {d.zero_stage}) and in bf16 "
             f"on several processes (train.precision {t.precision}), where it would silently train unfactored; "
             "use one process, or fp32 with distributed.zero_stage 0, or another optimizer")
        need(o is None or not o.one_step_size or (d.zero_stage == 0 and d.pipeline_stages <= 1), "train.optimizer",
             f"{t.optimizer} estimates one step size from all the weights, but ZeRO (distributed.zero_stage "
             f"{d.zero_stage}) and pipeline stages ({d.pipeline_stages}) give each process a share of them, so "
             "each would estimate its own; use distributed.zero_stage 0 and one pipeline stage")
        # DeepSpeed's bf16 optimizer splits its fp32 weights across data-parallel processes even at stage 0
        need(o is None or not o.one_step_size or t.precision == "fp32" or (d.processes <= 1 and not d.hostfile),
             "train.optimizer", f"{t.optimizer} in bf16 on several processes (distributed.processes {d.processes}, "
             f"distributed.zero_stage {d.zero_stage}): DeepSpeed's bf16 optimizer gives each process a share "
             "of the weights, so each would estimate its own step size; use train.precision fp32 or one process")
        need(o is None or not o.schedule_free or (d.zero_stage == 0 and t.precision == "fp32"),
             "train.optimizer", f"{t.optimizer} evaluates and saves its averaged weights, which it can swap into "
             f"the model only where it updates the model's own weights: not DeepSpeed's fp32 copies under ZeRO "
             f"(distributed.zero_stage {d.zero_stage}) or bf16 (train.precision {t.precision}); use fp32 with "
             "distributed.zero_stage 0")
        need(d.pipeline_stages <= 1 or not s.every, "samples.every", "previews need the whole model in one "
             "process; they are not available with pipeline stages")
        problems += self.block_swap_problems()
        if self.task == "distill":
            problems += self.distill.problems(self)
        return problems

    def block_swap_conflicts(self) -> list[tuple[str, str]]:
        """Every setting block swap cannot run with, as (field under distributed, why), whether or not block_swap is
        set: the one rule that validation, the memory plan's choice and the out-of-memory suggestions share."""
        return self.distributed.block_swap_conflicts() + self._run_block_swap_conflicts()

    def block_swap_problems(self) -> list[str]:
        """Where block_swap is set, the run's settings it cannot run with (the layout's own are
        distributed.problems()'s), as validate reports them; the Distill node asks the same at queue time."""
        if not self.distributed.block_swap:
            return []
        return [f"distributed.{name}: {why}" for name, why in self._run_block_swap_conflicts()]

    def _run_block_swap_conflicts(self) -> list[tuple[str, str]]:
        return [(name, why) for ok, name, why in (
            (self.adapter.kind != "full", "block_swap", "block swap keeps frozen weights in CPU memory; a full "
             "fine-tune has none (use ZeRO-3 with offload instead)"),
            (self.task != "distill", "block_swap", "not yet for distillation (three models); use ZeRO-3 to spread "
             "them over processes, or set block_swap to 0"),
        ) if not ok]
