"""RunControl: what the training tasks' loop (trainer/tasks/base.py) does around each step: before the first, a
stale STOP mark dropped and the checkpoint resumed; after each, the previews when due, the STOP mark answered on
every rank alike and a checkpoint when due; and the step times behind the events' ETA and mean step time."""
from __future__ import annotations

import time
from pathlib import Path

from .checkpoint import Checkpointer
from .events import EventWriter
from ..optim import averaged_weights
from ..sampling import PreviewSampler, sample_due
from .stop_requests import StopRequests


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
