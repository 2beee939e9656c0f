"""Exponential moving average of the trained weights (train.ema_decay, train.ema_start_step).

The average is kept in fp32 on the weights' device, one tensor per trained parameter (the adapter's, or every
weight of a full fine-tune), and updated after each optimizer step from the weights the model computes with; every
process holds whole weights in the layouts RunSpec.validate allows (no ZeRO-3, one pipeline stage), so every
process computes the same average. Under bf16 those weights are DeepSpeed's bf16 copies of its fp32 masters.
It travels in checkpoints (Checkpointer component) and can be swapped into the model for evaluation and export.
"""
from __future__ import annotations

import contextlib

import torch


class WeightAverage:
    def __init__(self, params: list, decay: float, start_step: int):
        self.params, self.decay, self.start_step = params, decay, start_step
        self.average = [p.detach().to(torch.float32, copy=True) for p in params]

    @torch.no_grad()
    def update(self, step: int):
        """After optimizer step `step` (1-based): up to start_step the average is the weights themselves."""
        current = [p.detach().float() for p in self.params]
        if step <= self.start_step:
            torch._foreach_copy_(self.average, current)
        else:
            torch._foreach_lerp_(self.average, current, 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self):
        """Within: the model's trained weights are the average (cast to their dtype); restored exactly after."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            for p, a in zip(self.params, self.average):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    p.copy_(k)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "start_step": self.start_step,
                "average": [a.detach().to("cpu", copy=True) for a in self.average]}

    def load_state_dict(self, state: dict, where: str):
        saved = state.get("average") if isinstance(state, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.average) \
                or any(s.shape != a.shape for s, a in zip(saved, self.average)):
            raise ValueError(f"{where}: its EMA does not match this run's trained weights")
        with torch.no_grad():
            for a, s in zip(self.average, saved):
                a.copy_(s)


def build_average(spec, params: list) -> WeightAverage | None:
    t = spec.train
    return WeightAverage(params, t.ema_decay, t.ema_start_step) if t.ema_decay > 0 else None


def exported_weights(spec, average: WeightAverage | None):
    """The weights the run's file holds (output.weights): the trained ones, or their average swapped in."""
    if spec.output.weights == "ema" and average is not None:
        return average.swapped_in()
    return contextlib.nullcontext()
