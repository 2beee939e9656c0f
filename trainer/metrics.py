"""Training health metrics in TensorBoard (the Lightning seed's set), written by rank 0 only."""
from __future__ import annotations

from pathlib import Path

TENSORBOARD_DIR = "tensorboard"


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
