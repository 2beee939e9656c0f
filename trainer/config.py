"""The run spec: typed dataclasses loaded from TOML and validated once, with errors that name the field.

Both sides use this module: the Train node writes a spec, the trainer program reads it. It imports
only the standard library so that loading it in the ComfyUI process costs nothing.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from .optim import OPTIMIZERS_KNOWN, optimizer_named

SPEC_VERSION = 1


# the timestep quantiles evaluation measures at, unless a spec or node says otherwise (as nodes show it: text)
DEFAULT_EVAL_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_EVAL_QUANTILES_TEXT = ", ".join(f"{q:g}" for q in DEFAULT_EVAL_QUANTILES)


@dataclass(frozen=True)
class Choice:
    """One option of a setting: the value the run spec holds, the label a node shows (saved workflows store the
    label: never rename one), and what it does (for the node's tooltip)."""
    value: str
    label: str
    tooltip: str


def choice_values(choices: tuple[Choice, ...]) -> tuple[str, ...]:
    return tuple(c.value for c in choices)


def choice_labels(choices: tuple[Choice, ...]) -> list[str]:
    return [c.label for c in choices]


def choice_value(choices: tuple[Choice, ...], label: str, where: str) -> str:
    """The spec value of a node's label (a spec value is accepted too); the error names the input."""
    for c in choices:
        if label in (c.label, c.value):
            return c.value
    raise ValueError(f"{where}: {label!r} is not one of {choice_labels(choices)}")


def choices_tooltip(choices: tuple[Choice, ...]) -> str:
    return " ".join(f"{c.label}: {c.tooltip}" for c in choices)


# Each choice of the spec, defined once; the tuples of values below are what validation checks.
ADAPTER_KIND_CHOICES = (
    Choice("lora", "LoRA", "low-rank update."),
    Choice("loha", "LoHa", "Hadamard product of two low-rank updates (more expressive at the same rank)."),
    Choice("lokr", "LoKr", "Kronecker product of two small matrices."),
    Choice("dora", "DoRA", "LoRA with a learned magnitude per output (weight-decomposed)."),
    Choice("full", "Full fine-tune", "every weight of the diffusion model trains; saved as a diffusion model."),
)
TARGET_CHOICES = (
    Choice("attention", "attention", "the attention projections."),
    Choice("attention_ff", "attention + feed-forward", "attention and feed-forward layers."),
    Choice("all_linear", "all linear layers", "every linear layer of the model's blocks."),
    Choice("all_layers", "all linear and convolution layers",
           "every linear and convolution layer (kohya's LoCon; where ComfyUI's own TrainLoraNode puts its LoRA). "
           "LoRA, LoHa and LoKr (these two leave 3-D convolutions out: a video model's patch embedding); DoRA "
           "trains linear layers only."),
)
ADAPTER_FORMAT_CHOICES = (
    Choice("comfyui", "ComfyUI", "diffusion_model.* keys, what ComfyUI's LoRA loaders read (every family)."),
    Choice("kohya", "kohya (lora_unet_*)", "lora_unet_* keys for kohya-based tools (ComfyUI reads these too)."),
    Choice("diffusers", "diffusers (peft)", "unet.*.lora_A/B keys that diffusers loads (SD UNets, plain LoRA only)."),
)
# the optimizers are records of their own (optim.OPTIMIZERS_KNOWN: what the node shows, and what each needs of the
# layout, which validate() below reads); they serve as the node's choices as they are
OPTIMIZER_CHOICES = OPTIMIZERS_KNOWN
SCHEDULE_CHOICES = (
    Choice("constant", "constant", "the learning rate stays as set after the warmup."),
    Choice("linear", "linear decay", "falls linearly to 0 at the last step after the warmup."),
    Choice("cosine", "cosine decay", "falls along a half cosine to 0 at the last step after the warmup."),
)
PRECISION_CHOICES = (
    Choice("bf16", "bf16", "bfloat16 weights and activations, fp32 master copies of the trained weights: half the "
           "memory."),
    Choice("fp32", "fp32", "float32 throughout: exact and repeatable, slower."),
    Choice("auto", "auto", "bf16 where the GPU computes in it (Ampere and newer) and on a CPU; fp16 on older GPUs "
           "(Turing, Pascal), decided by the trainer on its own device (trainer/device.py)."),
    Choice("fp16", "fp16", "float16 weights and activations with dynamic loss scaling (a step whose gradients "
           "overflow is skipped and the scale halved): for GPUs without bf16."),
)
LOSS_CHOICES = (
    Choice("mse", "MSE", "mean squared error."),
    Choice("huber", "Huber", "less pulled by outlier images and noisy captions (train.huber_delta)."),
)
OUTPUT_WEIGHTS_CHOICES = (
    Choice("trained", "trained", "the weights as the last step left them."),
    Choice("ema", "EMA", "the exponential moving average of the weights (train.ema_decay)."),
)
TIMESTEP_SAMPLING_CHOICES = (
    Choice("uniform", "uniform", "every noise level equally often."),
    Choice("logit_normal", "logit-normal", "more steps at mid noise (SD3's; train.logit_mean, train.logit_std)."),
)
MEMORY_CHOICES = (
    Choice("auto", "auto", "the memory plan turns on gradient checkpointing, then block swap, only where the run "
           "would not fit the device's free memory; a run nothing fits is refused before it starts."),
    Choice("manual", "manual", "the settings as given; where the plan says they will not fit, the node warns and "
           "the run starts anyway."),
)

TARGET_PRESETS = choice_values(TARGET_CHOICES)
ADAPTER_KINDS = choice_values(ADAPTER_KIND_CHOICES)  # full: every weight of the diffusion model trains
ADAPTER_FORMATS = choice_values(ADAPTER_FORMAT_CHOICES)
OPTIMIZERS = choice_values(OPTIMIZER_CHOICES)
SCHEDULES = choice_values(SCHEDULE_CHOICES)
PRECISIONS = choice_values(PRECISION_CHOICES)
LOSSES = choice_values(LOSS_CHOICES)
MEMORY_MODES = choice_values(MEMORY_CHOICES)
OUTPUT_WEIGHTS = choice_values(OUTPUT_WEIGHTS_CHOICES)
PREDICTIONS = ("auto", "epsilon", "v_prediction", "flow")
TIMESTEP_SAMPLING = choice_values(TIMESTEP_SAMPLING_CHOICES)
TASKS = ("train", "evaluate", "distill")  # distill: DMD2 few-step distillation (trainer/distill.py)
DISTILL_STUDENT_KINDS = ("lora", "full")  # adapter kinds a distilled student trains as
MODEL_FORMATS = ("diffusion_model", "checkpoint")  # how ComfyUI loads model.path: UNETLoader / Load Checkpoint
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")  # UNETLoader's weight_dtype
BASE_PRECISION_CHOICES = (  # the frozen base weights in the trainer
    Choice("as_loaded", "as loaded", "the base weights in the precision the graph loaded them (Load Diffusion "
           "Model's weight_dtype; otherwise the training precision)."),
    Choice("fp8", "fp8", "the base weights stored in fp8 (e4m3fn) and computed layer by layer in the training "
           "precision, as ComfyUI's fp8 loading does: half the memory of bf16. Adapters and optimizer state stay "
           "in full precision; full fine-tuning and DoRA refuse it."),
)
BASE_PRECISIONS = choice_values(BASE_PRECISION_CHOICES)
VAE_FORMATS = ("vae", "checkpoint")  # samples.vae_path: a VAE file (VAELoader) or the VAE inside a checkpoint


class RunSpecError(ValueError):
    """A run spec that cannot be used; the message names the file and the field."""


@dataclass
class ModelSpec:
    """Where the trainer rebuilds the graph's MODEL from, with ComfyUI's own loading and patching code:
    the source file as its loader node read it, then the upstream LoRAs applied in order."""
    path: str = ""  # the source weights: a diffusion-model file, a whole checkpoint, or a materialised copy
    format: str = "diffusion_model"  # one of MODEL_FORMATS
    weight_dtype: str = "default"  # one of WEIGHT_DTYPES, as UNETLoader was given it
    lora_paths: list = field(default_factory=list)  # upstream LoRA files, applied in this order
    lora_strengths: list = field(default_factory=list)  # strength_model of each, same length
    # size and mtime (ns) of path and each LoRA, "size:mtime_ns", checked before loading (no content hashing)
    stamps: list = field(default_factory=list)
    base_precision: str = "as_loaded"  # one of BASE_PRECISIONS
    family: str = "auto"
    prediction: str = "auto"  # taken from the graph's MODEL by the Train node


@dataclass
class DataSpec:
    manifest: str = ""  # dataset manifest written by the cache (see cache/store.py)
    shuffle: bool = True
    eval_manifest: str = ""  # held-out evaluation set ("" = evaluate on the training images)
    caption_dropout: float = 0.0  # share of training samples that see the empty caption (its embedding is cached)
    shuffle_tags: bool = True  # draw among the manifest's cached tag-shuffled caption variants, where it has them
    masked_loss: bool = True  # weight the loss by the masks cached with the latents, where the manifest has them
    prior_manifest: str = ""  # prior (regularisation) images mixed into every batch ("" = none)
    prior_weight: float = 1.0  # loss weight of the prior items (kohya's prior_loss_weight)
    prior_fraction: float = 0.5  # share of each global batch's slots that hold prior items (rounded; >= 1 slot)


@dataclass
class AdapterSpec:
    kind: str = "lora"
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "attention"
    init_from: str = ""  # continue from this adapter file (one this trainer wrote, any format; same kind and rank)


@dataclass
class TrainSpec:
    steps: int = 100
    batch_size: int = 1
    grad_accum: int = 1
    learning_rate: float = 1e-4
    optimizer: str = "adamw"
    weight_decay: float = 0.01
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    precision: str = "bf16"
    gradient_checkpointing: bool = False
    # "auto": the memory plan turns on checkpointing and block swap where the run would not fit the device, and
    # refuses a run nothing fits (trainer/memory_plan.py); "manual": the settings as given, a warning at most
    memory: str = "auto"
    memory_budget_gb: float = 0.0  # the device memory a run may fill; 0: the device's free memory
    max_grad_norm: float = 1.0
    loss: str = "mse"  # or "huber" (robust to outliers); evaluation always uses MSE
    huber_delta: float = 0.1  # where the Huber loss turns from quadratic to linear
    min_snr_gamma: float = 0.0  # min-SNR weighting of the training loss (0 = off; 5 is the usual value)
    timestep_sampling: str = "uniform"  # or "logit_normal" (SD3's: more steps at mid noise)
    logit_mean: float = 0.0  # logit-normal location and scale
    logit_std: float = 1.0
    flow_shift: float = 1.0  # flow-matching models: sigma = s*t / (1 + (s-1)*t); 1 = no shift, 3 = SD3's
    guidance: float = 1.0  # the guidance input of guidance-distilled models (Flux dev) while training
    seed: int = 0
    save_every: int = 0  # 0: only the final adapter
    keep_last: int = 3  # complete checkpoints kept (the oldest go first); 0 = keep all
    eval_quantiles: list = field(default_factory=lambda: list(DEFAULT_EVAL_QUANTILES))
    eval_every: int = 0  # 0: evaluate after the last step only (and before the first with eval_before)
    eval_items: int = 8  # items evaluated: a fixed subset of the eval set, seeded by `seed`; 0: no evaluation
    eval_before: bool = False  # also evaluate before the first step (a baseline; the Evaluate node gives one too)
    eval_after_stop: bool = False  # evaluate after a run ended by Stop too (it ends sooner without)
    resume: str = ""  # "": fresh run; "latest": newest complete checkpoint; or a checkpoint tag
    ema_decay: float = 0.0  # exponential moving average of the trained weights (0 = off; 0.999 is usual)
    ema_start_step: int = 0  # until this step the average copies the weights; it averages from the next one

    @property
    def evaluates(self) -> bool:
        """Whether a training run evaluates at all (eval_items 0 or no quantiles: it does not)."""
        return self.eval_items > 0 and bool(self.eval_quantiles)


@dataclass
class SampleSpec:
    """Preview images rendered with ComfyUI's sampling on the current weights during training."""
    every: int = 0  # 0: no previews
    conditioning: str = ""  # safetensors with the encoded prompts (written by the Train node)
    vae_path: str = ""  # VAE weights (ComfyUI keys) that decode the previews
    vae_format: str = "vae"  # one of VAE_FORMATS
    prompts: list = field(default_factory=list)  # the prompt texts, for labels
    steps: int = 20
    cfg: float = 7.0
    sampler: str = "euler"
    scheduler: str = "normal"
    seed: int = 0
    width: int = 512
    height: int = 512


@dataclass
class OutputSpec:
    lora_path: str = ""  # final adapter (models/loras), or the full fine-tune (models/diffusion_models); atomic
    name: str = "lora"
    overwrite: bool = False  # replace a file at lora_path that this pack did not write (else refuse)
    format: str = "comfyui"  # key layout of the adapter file: comfyui, kohya or diffusers (see trainer/export.py)
    weights: str = "trained"  # one of OUTPUT_WEIGHTS: the trained weights, or their EMA (train.ema_decay > 0)


@dataclass
class DistillSpec:
    """DMD2 few-step distillation (task "distill"): the graph's MODEL is the frozen teacher (the real score); the
    student (the generator) starts as a copy of it and trains as adapter.kind (a LoRA: a "turbo LoRA" for the
    teacher; or full); the fake score, also a copy of the teacher, follows the student's output distribution.
    train.steps counts generator updates; train.learning_rate is the generator's."""
    student_steps: int = 4  # the student's sampling steps (1-4)
    student_timesteps: list = field(default_factory=list)  # its noise levels as t in (0, 1], descending; [] = even
    guidance_scale: float = 1.75  # the teacher's classifier-free guidance for the real score (empty caption)
    fake_learning_rate: float = 1e-4  # the fake score's learning rate
    fake_updates: int = 5  # fake-score updates per generator update (DMD2's two time-scale rule)
    # multi-step students: one fake score per student step, each following that step's outputs. One fake score
    # (DMD2's) follows the mixture of every step's outputs, so only the mixture is matched to the teacher: steps can
    # drift apart in ways that cancel in it (tools/distill_quality.py measured it), which the last step's samples show
    fake_score_per_step: bool = False
    dmd_weight: float = 1.0  # the distribution-matching loss of the generator
    denoising_weight: float = 1.0  # the fake score's denoising loss on the generator's outputs
    gan_weight: float = 0.0  # the GAN term on the fake score's features (0 = off)
    regression_steps: int = 0  # warm-up: the first generator updates regress on the dataset's latents instead
    backward_simulation: bool = True  # multi-step students: each update's input comes from the student's own steps
    min_t: float = 0.02  # the noise levels the DMD gradient and the fake score are trained at
    max_t: float = 0.98

    def problems(self, spec) -> list[str]:
        """What is wrong with these settings (a run whose task is "distill")."""
        ts = self.student_timesteps
        rules = [
            (1 <= self.student_steps <= 4, "student_steps", f"must be 1 to 4 (got {self.student_steps})"),
            (not ts or (len(ts) == self.student_steps and all(isinstance(v, (int, float)) and 0 < v <= 1 for v in ts)
                        and list(ts) == sorted(ts, reverse=True)), "student_timesteps",
             f"give {self.student_steps} noise level(s) in (0, 1], highest first (one per student step), or leave it "
             f"empty for evenly spaced ones (got {ts})"),
            (self.guidance_scale >= 1.0, "guidance_scale", f"must be 1 (no guidance) or more (got {self.guidance_scale})"),
            (self.fake_learning_rate > 0, "fake_learning_rate", f"must be positive (got {self.fake_learning_rate})"),
            (self.fake_updates >= 1, "fake_updates", f"must be at least 1 (got {self.fake_updates})"),
            (self.dmd_weight >= 0 and self.denoising_weight > 0 and self.gan_weight >= 0, "dmd_weight",
             "dmd_weight and gan_weight must be 0 or more and denoising_weight positive"),
            (self.regression_steps >= 0, "regression_steps", f"must be 0 or more (got {self.regression_steps})"),
            (not (self.fake_score_per_step and self.gan_weight > 0), "fake_score_per_step",
             "the GAN term is not yet kept with a fake score per student step: set gan_weight to 0, or use one "
             "fake score"),
            (0.0 <= self.min_t < self.max_t <= 1.0, "min_t", f"needs 0 <= min_t < max_t <= 1 (got {self.min_t}, "
                                                             f"{self.max_t})"),
            (spec.adapter.kind in DISTILL_STUDENT_KINDS, "adapter.kind",
             f"the student trains as a LoRA or in full (got {spec.adapter.kind!r})"),
            (spec.distributed.pipeline_stages <= 1, "distributed.pipeline_stages",
             "distillation runs three models on whole-model layouts (ZeRO 0-3); use 1 stage"),
            (not spec.distributed.block_swap, "distributed.block_swap", "not yet for distillation (three models); "
             "use ZeRO-3 to spread them over processes, or set block_swap to 0"),
            (spec.train.ema_decay <= 0, "train.ema_decay", "the weight average is not yet kept for distillation; "
                                                          "set it to 0"),
        ]
        return [f"{name if '.' in name else 'distill.' + name}: {message}" for ok, name, message in rules if not ok]

    def guidance_caption_problem(self, has_empty_caption: bool, cache: str) -> str | None:
        """The teacher's classifier-free guidance (guidance_scale above 1) takes the empty caption's embedding from
        the dataset's cache (`cache`: what to call it), which Cache Text Embeddings writes."""
        if self.guidance_scale > 1.0 and not has_empty_caption:
            return (f"distill.guidance_scale: the teacher's classifier-free guidance needs the empty caption's "
                    f"embedding, which {cache} lacks (a cache written before Cache Text Embeddings always stored it); "
                    "queue Cache Text Embeddings again, or set guidance_scale to 1")
        return None


@dataclass
class DistributedSpec:
    processes: int = 1  # processes (GPUs) per machine
    zero_stage: int = 0
    offload_optimizer: bool = False  # optimizer state in CPU memory (ZeRO 1-3)
    hostfile: str = ""  # DeepSpeed hostfile for several machines ("" = this machine only)
    pipeline_stages: int = 1  # the model split across this many processes (layers partitioned by parameters)
    block_swap: int = 0  # adapter training: this many blocks keep their frozen weights in CPU memory

    def problems(self) -> list[str]:
        """What is wrong with this layout on its own (the DeepSpeed Settings node and RunSpec.validate)."""
        hostfile_problem = _hostfile_problem(self.hostfile)
        rules = [
            (self.zero_stage in (0, 1, 2, 3), "zero_stage", f"must be 0, 1, 2 or 3 (got {self.zero_stage})"),
            (self.processes >= 1, "processes", f"must be at least 1 (got {self.processes})"),
            (not self.offload_optimizer or self.zero_stage >= 1, "offload_optimizer", "needs ZeRO stage 1, 2 or 3"),
            (hostfile_problem is None, "hostfile", hostfile_problem),
            (self.pipeline_stages >= 1, "pipeline_stages", f"must be at least 1 (got {self.pipeline_stages})"),
            (bool(self.hostfile) or self.pipeline_stages < 1 or self.processes % self.pipeline_stages == 0,
             "pipeline_stages", f"{self.pipeline_stages} stages do not divide {self.processes} processes"),
            (self.pipeline_stages <= 1 or self.zero_stage <= 1, "pipeline_stages",
             f"DeepSpeed pipelines take ZeRO stage 0 or 1 (zero_stage is {self.zero_stage})"),
            (self.pipeline_stages <= 1 or self.block_swap == 0, "block_swap", "block swap is for one pipeline stage"),
            (self.block_swap >= 0, "block_swap", f"must be 0 or more (got {self.block_swap})"),
            (not self.block_swap or self.zero_stage <= 2, "block_swap",
             "ZeRO-3 partitions the weights itself; use stage 0-2"),
        ]
        problems = [f"distributed.{name}: {message}" for ok, name, message in rules if not ok]
        needs = self.deepspeed_settings()
        if needs and not problems and not deepspeed_installed():
            problems.append(f"distributed.{needs[0]}: {getattr(self, needs[0])} needs DeepSpeed, which is not "
                            f"installed in this Python; install the multi-GPU extra with `{MULTI_GPU_INSTALL}` (one "
                            "process without ZeRO, a pipeline or a hostfile needs none)")
        return problems

    def deepspeed_settings(self) -> list[str]:
        """The settings that make this layout DeepSpeed's (several processes, another machine, ZeRO, a pipeline);
        none: one process in plain PyTorch (trainer/plain_engine.py)."""
        return [name for name, on in (("processes", self.processes > 1), ("hostfile", bool(self.hostfile)),
                                      ("zero_stage", self.zero_stage > 0),
                                      ("pipeline_stages", self.pipeline_stages > 1),
                                      ("offload_optimizer", self.offload_optimizer)) if on]

    @property
    def needs_deepspeed(self) -> bool:
        return bool(self.deepspeed_settings())


MULTI_GPU_INSTALL = "python -m pip install -r requirements-multi-gpu.txt"  # run in the pack's folder


def deepspeed_installed() -> bool:
    """Without importing it (2-10 s, and a one-process run must not)."""
    import importlib.util
    return importlib.util.find_spec("deepspeed") is not None


def _hostfile_problem(path: str) -> str | None:
    from .hostfile import HostfileError, parse_hostfile
    if not path:
        return None
    try:
        parse_hostfile(path)
    except HostfileError as exc:
        return str(exc)
    return None


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
        need(not d.block_swap or a.kind != "full", "distributed.block_swap", "block swap keeps frozen weights in "
             "CPU memory; a full fine-tune has none (use ZeRO-3 with offload instead)")
        if self.task == "distill":
            problems += self.distill.problems(self)
        if problems:
            raise RunSpecError(f"{source}: " + "; ".join(problems))
        return self


def _from_dict(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise RunSpecError(f"{where}: expected a table")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise RunSpecError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, hint, path = data[f.name], hints[f.name], f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(hint):
            value = _from_dict(hint, value, path)
        elif hint is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif hint in (int, float, str, bool, list) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
            raise RunSpecError(f"{path}: expected {hint.__name__}, got {type(value).__name__} {_short(value)}")
        if hint is float and not math.isfinite(value):
            raise RunSpecError(f"{path}: must be a finite number (got {value})")
        kwargs[f.name] = value
    return cls(**kwargs)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def spec_from_dict(data: dict, source: str = "run spec") -> RunSpec:
    try:
        spec = _from_dict(RunSpec, data, "")
    except RunSpecError as exc:
        raise RunSpecError(f"{source}: {exc}") from None
    return spec.validate(source)


def load_run_spec(path: str | Path) -> RunSpec:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RunSpecError(f"{path}: run spec not found") from None
    return parse_run_spec(raw, str(path))


def parse_run_spec(raw: bytes, source: str) -> RunSpec:
    """A spec from the bytes already read (the trainer checks the signature of exactly these bytes)."""
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RunSpecError(f"{source}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise RunSpecError(f"{source}: not valid TOML ({exc})") from None
    except RecursionError:
        raise RunSpecError(f"{source}: nested too deeply") from None
    return spec_from_dict(data, source)


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cannot write the non-finite number {value} to a run spec")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_TOML_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7f else ch)
                             for ch in value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_run_spec(spec: RunSpec) -> str:
    lines, tables = [], []
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if dataclasses.is_dataclass(value):
            tables.append((f.name, value))
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    for name, table in tables:
        lines.append(f"\n[{name}]")
        for f in dataclasses.fields(table):
            lines.append(f"{f.name} = {_toml_value(getattr(table, f.name))}")
    return "\n".join(lines) + "\n"
