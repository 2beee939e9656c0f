"""Training health metrics in TensorBoard (the Lightning seed's set), written by rank 0 only."""
from __future__ import annotations

from pathlib import Path

TENSORBOARD_DIR = "tensorboard"
PARAM_NORM_EVERY = 10  # the parameter norm is a pass over every trained weight: not every step


def param_norm_due(step: int, first: int, last: int) -> bool:
    """The steps whose health record (and step event) carry the parameter norm: the first and last step of
    the run and every PARAM_NORM_EVERY-th."""
    return step in (first, last) or step % PARAM_NORM_EVERY == 0


def param_norm(params) -> float:
    import torch
    return torch.stack([p.detach().float().norm() for p in params]).norm().item()


class HealthLog:
    def __init__(self, run_dir: str | Path, enabled: bool):
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))

    def step(self, step: int, **scalars):
        if self._writer is None:
            return
        for name, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(name, float(value), step)

    def eval(self, step: int, result: dict):
        if self._writer is None:
            return
        self._writer.add_scalar("eval/loss", result["loss"], step)
        for q, value in result["quantiles"].items():
            self._writer.add_scalar(f"eval/loss_q{q}", value, step)

    def close(self):
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
