"""Each setting's options, defined once: the value the run spec holds, the label a node shows (saved workflows
store the label: never rename one) and what it does (the node's tooltip); the tuples of values validation checks.
Standard library only, as the whole spec package."""
from __future__ import annotations

from dataclasses import dataclass

from ..optim import OPTIMIZERS_KNOWN

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


def named_inputs(problems: list[str], inputs: dict[str, str]) -> list[str]:
    """The spec's problems ("train.grad_accum: why") as a node's ("gradient_accumulation: why"): each field that
    `inputs` maps to the node's input is named by it; the others keep their dotted field."""
    named = []
    for problem in problems:
        where, _, why = problem.partition(": ")
        named.append(f"{inputs[where]}: {why}" if where in inputs else problem)
    return named


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
# v_prediction_ddpm: CogVideoX's (ComfyUI's V_PREDICTION_DDPM: v-prediction on the unscaled noisy latent)
PREDICTIONS = ("auto", "epsilon", "v_prediction", "v_prediction_ddpm", "flow")
TIMESTEP_SAMPLING = choice_values(TIMESTEP_SAMPLING_CHOICES)
TASKS = ("train", "evaluate", "distill")  # distill: DMD2 few-step distillation (trainer/tasks/distill.py)
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
# the spec fields whose node input is a choice, each with its options (nodes/spec_inputs.py reads a label as its value)
CHOICE_FIELDS = {"adapter.kind": ADAPTER_KIND_CHOICES, "adapter.targets": TARGET_CHOICES,
                 "output.format": ADAPTER_FORMAT_CHOICES, "output.weights": OUTPUT_WEIGHTS_CHOICES,
                 "train.optimizer": OPTIMIZER_CHOICES, "train.lr_schedule": SCHEDULE_CHOICES,
                 "train.precision": PRECISION_CHOICES, "train.loss": LOSS_CHOICES,
                 "train.timestep_sampling": TIMESTEP_SAMPLING_CHOICES, "train.memory": MEMORY_CHOICES,
                 "model.base_precision": BASE_PRECISION_CHOICES}
