"""The STOP mark in the run folder: a request to save a checkpoint and end cleanly, answered by every rank alike."""
from __future__ import annotations

from pathlib import Path

import torch

from ..parallel.distributed import world_size
from .layout import STOP_FILE


_RUN_STARTED_AT: float | None = None  # set by a standby when it takes a run (trainer/tasks/standby.py)


def mark_run_start():
    """This process's run starts now: a standby's imports were done long before its run came."""
    global _RUN_STARTED_AT
    import time
    _RUN_STARTED_AT = time.time()


class StopRequests:
    def __init__(self, run_dir: str | Path, is_rank0: bool):
        self.stop = Path(run_dir) / STOP_FILE
        self.is_rank0 = is_rank0

    def drop_stale(self, started_at: float):
        """A STOP left from before this process started (a stop that came as the last run ended, a run resumed
        by hand) is not a request to this run; one written during start-up is."""
        if _RUN_STARTED_AT is not None:  # a standby: its run began at the hand-off
            started_at = _RUN_STARTED_AT
        else:
            try:
                import psutil  # a ComfyUI requirement: when this process began, imports included
                started_at = psutil.Process().create_time()
            except Exception:  # noqa: BLE001 - the run's own start is the next best answer
                pass
        try:
            if self.is_rank0 and self.stop.stat().st_mtime < started_at:
                self.stop.unlink()
        except FileNotFoundError:
            pass

    def requested(self, device) -> bool:
        """Rank 0 reads the STOP mark and every rank follows its answer, so all save the same step and
        no rank waits in a collective that another has left."""
        wanted = self.is_rank0 and self.stop.exists()
        if world_size() == 1:
            return wanted
        flag = torch.tensor([1 if wanted else 0], dtype=torch.int32, device=device)
        torch.distributed.broadcast(flag, src=0)
        return bool(flag.item())

    def consume(self):
        """A stop request is honoured once: a resumed run trains on until it is asked again."""
        if self.is_rank0:
            self.stop.unlink(missing_ok=True)
