"""What the trainer program's training tasks share, the adapter trainer (loop.py) and the distiller (distill.py):
TrainingTask, their shape (build once, then train) and the one loop skeleton, with the hooks in which they differ:
announce (the started event, and what comes before the first step), step (one optimizer step), report_step (its
event) and finish (the result and the finished event). RunControl (trainer/run/run_control.py) does what comes
around each step."""
from __future__ import annotations

import math
import time
from pathlib import Path

from ..data.loading import step_loader
from ..parallel.distributed import rank
from ..run.events import EventWriter


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being a finite number; the run ends without saving the bad weights."""


class OutOfDeviceMemory(RuntimeError):
    """The device ran out of memory; the message names the step, the peak and what would fit."""


def check_finite(step: int, loss: float | None, grad_norm: float | None):
    for what, value in (("loss", loss), ("gradient norm", grad_norm)):
        if value is not None and not math.isfinite(value):
            raise TrainingDiverged(f"{what} became {'NaN' if math.isnan(value) else 'inf'} at step {step}; "
                                   "the last complete checkpoint is intact (lower the learning rate, or resume)")


class TrainingTask:
    """A task that trains: build() its components once from the spec (among them `control`, a RunControl;
    `optimizer`; `batches`, the step batches; `device`), then train(); run() does both."""

    def __init__(self, spec, events: EventWriter):
        self.spec, self.events = spec, events
        self.run_dir = Path(spec.run_dir)
        self.is_rank0 = rank() == 0

    step_in_flight = 0  # the step being taken (0: while building), for the out-of-memory message
    load_memory: dict = {}  # memory.load_peak's report of the model's load
    data_wait = 0.0  # seconds the loop waited for its batches

    def build(self):
        raise NotImplementedError

    def announce(self, start_step: int, resumed_from):
        """The started event, and what the task does before its first step."""
        raise NotImplementedError

    def step(self, step: int, batch) -> tuple[dict, float | None]:
        """One optimizer step on `batch`: (its losses, global means, "loss" among them; the gradient norm)."""
        raise NotImplementedError

    def report_step(self, step: int, start_step: int, batch, lr: float, losses: dict, grad_norm, step_time: float):
        """The step's event (and what is due after it, before previews, stop and checkpoint)."""
        raise NotImplementedError

    def finish(self, step: int, stopped: bool, losses: dict):
        """The result written after the last step taken (`stopped`: by a Stop), and the finished event; returns
        the result's path."""
        raise NotImplementedError

    def train(self):
        t = self.spec.train
        start_step, resumed_from = self.control.resume(self.started_at)
        self.announce(start_step, resumed_from)
        loader = step_loader(self.batches, self.device)
        stopped, losses = False, {}
        for step in range(start_step + 1, t.steps + 1):  # `step`: the steps done once this one is
            self.step_in_flight = step
            t0 = time.perf_counter()
            batch = loader.get(step - 1, step if step < t.steps else None)
            self.data_wait += time.perf_counter() - t0
            lr = self.optimizer.param_groups[0]["lr"]
            losses, grad_norm = self.step(step, batch)
            self.report_step(step, start_step, batch, lr, losses, grad_norm, time.perf_counter() - t0)
            if self.control.after_step(step):  # previews, stop, checkpoint
                stopped = True
                break
        else:
            step = t.steps
        loader.close()
        return self.finish(step, stopped, losses)

    def log(self, level: str, message: str) -> None:
        self.events.emit("log", level=level, message=message)

    def host_memory(self) -> dict:
        """The run's host memory: the resident bytes when the model's load began and the peak since (the memory
        plan's measurement on a CPU is their difference)."""
        from ..os_support import host_memory
        before, peak = self.load_memory.get("rss_before"), host_memory()[1]
        if before is None or peak is None:
            return {}
        return {"rss_before_load": before, "peak": peak, "rise": peak - before}

    def run(self):
        import torch
        self.started_at = time.time()
        try:
            self.build()
            return self.train()
        except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError: the same class
            from ..parallel.memory import out_of_memory_message
            raise OutOfDeviceMemory(out_of_memory_message(self.spec, self.step_in_flight)) from None
