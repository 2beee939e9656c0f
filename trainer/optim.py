"""The optimizer and the learning-rate schedule named in the spec."""
from __future__ import annotations

import contextlib
import math

import torch


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
    maintained library's implementation (prodigyopt, schedulefree, pytorch-optimizer); which DeepSpeed layouts
    each may run under is RunSpec.validate's business."""
    t = spec.train
    lr, decay = t.learning_rate, t.weight_decay
    if t.optimizer == "adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=decay)
    if t.optimizer == "prodigy":
        from prodigyopt import Prodigy
        return Prodigy(params, lr=lr, weight_decay=decay)
    if t.optimizer == "adafactor":
        from pytorch_optimizer.optimizer.adafactor import AdaFactor
        # the learning rate as given (no relative step or parameter scaling); the first moment kept in fp32
        return AdaFactor(params, lr=lr, weight_decay=decay, relative_step=False, scale_parameter=False,
                         warmup_init=False, momentum_dtype=torch.float32)
    if t.optimizer == "came":
        from pytorch_optimizer.optimizer.came import CAME
        return CAME(params, lr=lr, weight_decay=decay)
    if t.optimizer == "lion":
        from pytorch_optimizer.optimizer.lion import Lion
        return Lion(params, lr=lr, weight_decay=decay)
    if t.optimizer == "adamw_schedulefree":
        from schedulefree import AdamWScheduleFree
        optimizer = AdamWScheduleFree(params, lr=lr, weight_decay=decay)
        optimizer.train()  # it steps only in train mode; averaged_weights() switches around evaluation and export
        return optimizer
    return torch.optim.AdamW(params, lr=lr, weight_decay=decay)


@contextlib.contextmanager
def averaged_weights(optimizer):
    """Within: the model holds the weights a schedule-free optimizer evaluates and saves (its average x, not the
    point y the gradients are taken at); other optimizers' weights are left alone. RunSpec.validate keeps
    schedule-free to the layouts where the optimizer's params are the model's own (fp32, ZeRO stage 0), so
    eval() and train() change the weights the model computes with. Collective-free: every process does it."""
    if not (optimizer.param_groups and "train_mode" in optimizer.param_groups[0]):
        yield
        return
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
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
