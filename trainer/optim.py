"""The optimizers, each one record (what the node shows, where its class lives, what it needs of the layout, its
state's size), and the optimizer and learning-rate schedule a spec names. Importing this module imports nothing but
the standard library (config reads the records in the ComfyUI process); torch and each optimizer's library are
imported when one is built."""
from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Optimizer:
    """One optimizer. `value`, `label`, `tooltip`: as spec.Choice (saved workflows store the label: never rename
    one). The class is `module`.`cls` from the package `library`, built with (params, lr=, weight_decay=, **kwargs);
    a keyword ending in `_dtype` names a torch dtype. What DeepSpeed's wrappers would change, which RunSpec.validate
    refuses: `factored` (it factors each weight matrix's second moment; DeepSpeed's bf16 and ZeRO optimizers hand it
    flattened 1-D copies), `one_step_size` (it estimates one step size from all the weights; ZeRO, pipeline stages
    and DeepSpeed's bf16 optimizer on several processes give each process a share), `schedule_free` (it swaps its
    averaged weights into its params for evaluation and export, which must be the model's own: fp32, ZeRO stage 0).
    `optional`: its library stays hidden from the trainer until a run asks for it (peft would import it, 2 s, for
    nothing). `state_bytes`: its state per trained parameter (the memory plan's)."""
    value: str
    label: str
    tooltip: str
    module: str
    cls: str
    library: str
    kwargs: tuple = field(default=())  # (name, value) pairs
    state_bytes: int = 8
    factored: bool = False
    one_step_size: bool = False
    schedule_free: bool = False
    optional: bool = False


OPTIMIZERS_KNOWN = (
    Optimizer("adamw", "AdamW", "torch's AdamW.", "torch.optim", "AdamW", "torch"),
    Optimizer("adamw8bit", "AdamW 8-bit", "bitsandbytes' 8-bit AdamW (less optimizer memory).", "bitsandbytes.optim",
              "AdamW8bit", "bitsandbytes", state_bytes=2, optional=True),
    Optimizer("prodigy", "Prodigy", "prodigyopt's Prodigy: estimates the step size itself (set the learning rate to "
              "1.0; ZeRO stage 0, one pipeline stage).", "prodigyopt", "Prodigy", "prodigyopt", state_bytes=16,
              one_step_size=True),
    # the learning rate as given (no relative step or parameter scaling); the first moment kept in fp32
    Optimizer("adafactor", "Adafactor", "pytorch-optimizer's Adafactor: factored second moments, little optimizer "
              "memory (fp32 and ZeRO stage 0: DeepSpeed's bf16 and ZeRO optimizers hand it flattened weights).",
              "pytorch_optimizer.optimizer.adafactor", "AdaFactor", "pytorch_optimizer",
              (("relative_step", False), ("scale_parameter", False), ("warmup_init", False),
               ("momentum_dtype", "float32")), state_bytes=4, factored=True),
    Optimizer("came", "CAME", "pytorch-optimizer's CAME: Adafactor's memory with a confidence-guided update (fp32 "
              "and ZeRO stage 0, as Adafactor).", "pytorch_optimizer.optimizer.came", "CAME", "pytorch_optimizer",
              state_bytes=4, factored=True),
    Optimizer("lion", "Lion", "pytorch-optimizer's Lion: sign updates, one moment (use a 3-10x lower learning rate "
              "than AdamW).", "pytorch_optimizer.optimizer.lion", "Lion", "pytorch_optimizer", state_bytes=4),
    Optimizer("adamw_schedulefree", "AdamW schedule-free", "schedulefree's AdamW: no decay schedule needed; "
              "evaluation, previews and the saved file use its averaged weights (fp32, ZeRO stage 0).",
              "schedulefree", "AdamWScheduleFree", "schedulefree", schedule_free=True),
    # decoupled weight decay, as AdamW's
    Optimizer("ademamix", "AdEMAMix", "pytorch-optimizer's AdEMAMix: AdamW with a second, slow moving average of the "
              "gradients beside the fast one (older gradients stay useful; one more moment of memory).",
              "pytorch_optimizer.optimizer.ademamix", "AdEMAMix", "pytorch_optimizer", (("weight_decouple", True),),
              state_bytes=12),
)


def optimizer_named(value: str) -> Optimizer | None:
    return next((o for o in OPTIMIZERS_KNOWN if o.value == value), None)


def optimizer_state_bytes(value: str) -> int:
    """Bytes of optimizer state per trained parameter (AdamW's where the name is unknown: validate refuses it)."""
    record = optimizer_named(value)
    return record.state_bytes if record else 8


def lr_lambda(spec):
    t = spec.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if t.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def build_optimizer(spec, params):
    """The spec's optimizer over `params`; only its own library is imported. Each is its authors' or a
    maintained library's implementation; which DeepSpeed layouts each may run under is RunSpec.validate's
    business (from the record's flags)."""
    import torch
    t = spec.train
    record = optimizer_named(t.optimizer)
    if record is None:
        raise ValueError(f"train.optimizer: {t.optimizer!r} is not one of {[o.value for o in OPTIMIZERS_KNOWN]}")
    kwargs = {name: getattr(torch, value) if name.endswith("_dtype") else value for name, value in record.kwargs}
    optimizer = getattr(importlib.import_module(record.module), record.cls)(
        params, lr=t.learning_rate, weight_decay=t.weight_decay, **kwargs)
    if record.schedule_free:
        optimizer.train()  # it steps only in train mode; averaged_weights() switches around evaluation and export
    return optimizer


@contextlib.contextmanager
def averaged_weights(optimizer):
    """Within: the model holds the weights a schedule-free optimizer evaluates and saves (its average x, not the
    point y the gradients are taken at); other optimizers' weights are left alone. RunSpec.validate keeps
    schedule-free to the layouts where the optimizer's params are the model's own (fp32, ZeRO stage 0), so
    eval() and train() change the weights the model computes with. Collective-free: every process does it."""
    if not (optimizer.param_groups and "train_mode" in optimizer.param_groups[0]):
        yield
        return
    import torch
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        kept = [p.detach().clone() for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()  # its mode back; the weights exactly as they were (train() after eval() is off by ulps)
        with torch.no_grad():
            for p, k in zip(params, kept):
                p.copy_(k)


def build_scheduler(spec, optimizer):
    import torch
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
