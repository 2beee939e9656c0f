"""The run spec's sections: typed dataclasses with their defaults, each with the rules that concern it alone where
it has them (the rules across sections are RunSpec.validate's, in run_spec.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .choices import ADAPTER_KIND_CHOICES, DEFAULT_EVAL_QUANTILES, DISTILL_STUDENT_KINDS


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
    # refuses a run nothing fits (trainer/parallel/memory_plan.py); "manual": the settings as given, a warning at most
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
        labels = {c.value: c.label for c in ADAPTER_KIND_CHOICES}
        rules = [
            (1 <= self.student_steps <= 4, "student_steps", f"must be 1 to 4 (got {self.student_steps})"),
            (not ts or (len(ts) == self.student_steps and all(isinstance(v, (int, float)) and 0 < v <= 1 for v in ts)
                        and list(ts) == sorted(ts, reverse=True)), "student_timesteps",
             f"give {self.student_steps} noise level(s) in (0, 1], highest first (one per student step), or leave it "
             f"empty for evenly spaced ones (got {ts})"),
            (self.guidance_scale >= 1.0, "guidance_scale",
             f"must be 1 (no guidance) or more (got {self.guidance_scale})"),
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
             f"the student trains as {' or '.join(labels[k] for k in DISTILL_STUDENT_KINDS)} (got "
             f"{labels.get(spec.adapter.kind, spec.adapter.kind)})"),
            # trainer/tasks/distill.py reads no adapter file: the student is the teacher's copy (a full fine-tune
            # from a file is refused for every task, by RunSpec's own rule)
            (not spec.adapter.init_from or spec.adapter.kind == "full", "adapter.init_from",
             "the student starts as a copy of the teacher, not from an adapter file (the LoRA Adapter node's "
             "continue_from: set it to none; to continue a distillation, resume its run)"),
            (spec.distributed.pipeline_stages <= 1, "distributed.pipeline_stages",
             "distillation runs three models on whole-model layouts (ZeRO 0-3); use 1 stage"),
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
    offload_params: bool = False  # ZeRO-3: each process's share of the weights in CPU memory, fetched per layer
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
            (not self.offload_params or self.zero_stage == 3, "offload_params",
             "needs ZeRO stage 3 (the stage that partitions the weights)"),
            (hostfile_problem is None, "hostfile", hostfile_problem),
            (self.pipeline_stages >= 1, "pipeline_stages", f"must be at least 1 (got {self.pipeline_stages})"),
            (bool(self.hostfile) or self.pipeline_stages < 1 or self.processes % self.pipeline_stages == 0,
             "pipeline_stages", f"{self.pipeline_stages} stages do not divide {self.processes} processes"),
            (self.pipeline_stages <= 1 or self.zero_stage <= 1, "pipeline_stages",
             f"DeepSpeed pipelines take ZeRO stage 0 or 1 (zero_stage is {self.zero_stage})"),
            (self.block_swap >= 0, "block_swap", f"must be 0 or more (got {self.block_swap})"),
        ]
        if self.block_swap:
            rules += [(False, name, why) for name, why in self.block_swap_conflicts()]
        problems = [f"distributed.{name}: {message}" for ok, name, message in rules if not ok]
        needs = self.deepspeed_settings()
        if needs and not problems and not deepspeed_installed():
            problems.append(f"distributed.{needs[0]}: {getattr(self, needs[0])} needs DeepSpeed, which is not "
                            f"installed in this Python; install the multi-GPU extra with `{MULTI_GPU_INSTALL}` (one "
                            "process without ZeRO, a pipeline or a hostfile needs none)")
        return problems

    def block_swap_conflicts(self) -> list[tuple[str, str]]:
        """The layout's settings block swap cannot run with, as (field, why), whether or not block_swap is set:
        RunSpec.block_swap_conflicts adds the run's."""
        return [(name, why) for ok, name, why in (
            (self.pipeline_stages <= 1, "block_swap", "block swap is for one pipeline stage"),
            (self.zero_stage <= 2, "block_swap", "ZeRO-3 partitions the weights itself; use stage 0-2"),
        ) if not ok]

    def deepspeed_settings(self) -> list[str]:
        """The settings that make this layout DeepSpeed's (several processes, another machine, ZeRO, a pipeline);
        none: one process in plain PyTorch (trainer/parallel/plain_engine.py)."""
        return [name for name, on in (("processes", self.processes > 1), ("hostfile", bool(self.hostfile)),
                                      ("zero_stage", self.zero_stage > 0),
                                      ("pipeline_stages", self.pipeline_stages > 1),
                                      ("offload_optimizer", self.offload_optimizer),
                                      ("offload_params", self.offload_params)) if on]

    @property
    def needs_deepspeed(self) -> bool:
        return bool(self.deepspeed_settings())


MULTI_GPU_INSTALL = "python -m pip install -r requirements-multi-gpu.txt"  # run in the pack's folder


def deepspeed_installed() -> bool:
    """Without importing it (2-10 s, and a one-process run must not)."""
    import importlib.util
    return importlib.util.find_spec("deepspeed") is not None


def _hostfile_problem(path: str) -> str | None:
    from ..parallel.hostfile import HostfileError, parse_hostfile
    if not path:
        return None
    try:
        parse_hostfile(path)
    except HostfileError as exc:
        return str(exc)
    return None
