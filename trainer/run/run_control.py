"""What the trainer program's training tasks share, the adapter trainer (trainer/tasks/loop.py) and the distiller
(trainer/tasks/distill.py): TrainingTask, their shape (build, then train); RunControl, what their loops do around each
step: before the first, a stale STOP mark dropped and the checkpoint resumed; after each, the previews when due,
the STOP mark answered on every rank alike and a checkpoint when due; and the step times behind the events' ETA
and mean step time."""
from __future__ import annotations

import time
from pathlib import Path

from .checkpoint import Checkpointer
from ..parallel.distributed import rank
from .events import EventWriter
from ..optim import averaged_weights
from ..sampling import PreviewSampler, sample_due
from .stop_requests import StopRequests


class TrainingTask:
    """A task that trains: build() its components once from the spec, then train(); run() does both."""

    def __init__(self, spec, events: EventWriter):
        self.spec, self.events = spec, events
        self.run_dir = Path(spec.run_dir)
        self.is_rank0 = rank() == 0

    def build(self):
        raise NotImplementedError

    def train(self):
        raise NotImplementedError

    step_in_flight = 0  # the step being taken (0: while building), for the out-of-memory message
    load_memory: dict = {}  # memory.load_peak's report of the model's load

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


class OutOfDeviceMemory(RuntimeError):
    """The device ran out of memory; the message names the step, the peak and what would fit."""


class RunControl:
    def __init__(self, spec, events: EventWriter, layout, optimizer, checkpointer: Checkpointer, is_rank0: bool):
        """`layout`: what the previews render (its module) and where the stop flag is broadcast (its device);
        `optimizer`: whose averaged weights (schedule-free) the previews see."""
        self.spec, self.events, self.layout, self.optimizer = spec, events, layout, optimizer
        self.checkpointer = checkpointer
        self.stops = StopRequests(spec.run_dir, is_rank0)
        self.previews: PreviewSampler | None = None  # set by the loop once it knows what to render
        self.step_times: list[float] = []

    def resume(self, started_at: float) -> tuple[int, Path | None]:
        """(the step to start from, the checkpoint it was restored from). Collective."""
        self.stops.drop_stale(started_at)
        return self.checkpointer.resume(self.spec.train.resume)

    def after_step(self, step: int) -> bool:
        """Previews, stop and checkpoint after `step`; True when a stop was asked before the last step: the run
        ends at this step (its checkpoint saved)."""
        t = self.spec.train
        if self.previews is not None and sample_due(self.spec.samples, step, t.steps):
            with averaged_weights(self.optimizer):
                images = self.previews.render(self.layout.module, step)
            self.events.emit("sample", step=step, images=images, prompts=self.spec.samples.prompts)
        stop_requested = self.stops.requested(self.layout.device)
        if self.checkpointer.due(step, t.steps, stop_requested):
            began = time.perf_counter()
            path = self.checkpointer.save(step, {"step": step, "seed": t.seed})
            self.events.emit("checkpoint", step=step, path=str(path), write_s=round(time.perf_counter() - began, 3))
        if stop_requested:
            self.stops.consume()
        return stop_requested and step < t.steps

    def timed(self, step: int, step_time: float) -> float:
        """Records the step's time; the seconds left at the mean of the last 20 steps."""
        self.step_times.append(step_time)
        recent = self.step_times[-20:]
        return sum(recent) / len(recent) * (self.spec.train.steps - step)

    def mean_step_s(self) -> float | None:
        """The mean step time, the first step (compilation, allocation) left out where there are others."""
        steady = self.step_times[1:] or self.step_times
        return sum(steady) / len(steady) if steady else None
