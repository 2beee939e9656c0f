"""The optimizer and the learning-rate schedule named in the spec."""
from __future__ import annotations

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
    t = spec.train
    if t.optimizer == "adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)


def build_scheduler(spec, optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
