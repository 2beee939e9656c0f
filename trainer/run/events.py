"""The event stream contract (DESIGN.md): versioned JSON objects, one per line, written by rank 0.

Events go to their own file in the run directory, never to stdout, so nothing DeepSpeed or
bitsandbytes prints can be mistaken for one. Readers tail the file by byte offset.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

EVENT_VERSION = 1
EVENT_TYPES = ("started", "step", "eval", "sample", "checkpoint", "log", "finished", "error")
from .layout import EVENTS_FILE  # noqa: F401  (re-exported)


def json_safe(value):
    """What JSON can carry: a non-finite number (a diverged loss) becomes null, a tensor or numpy scalar a float."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    try:
        return json_safe(float(value))
    except (TypeError, ValueError):
        return str(value)


def event_line(event: dict) -> str | None:
    """One terminal line for an event (the standalone trainer's progress); None for events not worth one."""
    kind = event.get("type")
    if kind == "started":
        doing = f"evaluating {event.get('eval_items')} items" if event.get("task") == "evaluate" else \
            f"{event.get('total')} steps from step {event.get('start_step')}"
        return f"started: {event.get('family')} model, {doing}, {event.get('precision')} on {event.get('device')}"
    if kind == "step":
        loss = event.get("loss")
        return f"step {event.get('step')}/{event.get('total')}: loss " + \
            (f"{loss:.4f}" if isinstance(loss, float) else "n/a") + f", {event.get('step_time_s') or 0:.2f} s/step"
    if kind == "eval":
        return f"eval at step {event.get('step')}: loss {event.get('loss')}"
    if kind == "checkpoint":
        return f"checkpoint: {event.get('path')}"
    if kind == "finished":
        kept = f" (the file it replaced is kept as {event['replaced_kept']})" if event.get("replaced_kept") else ""
        return f"finished after {event.get('steps')} steps: {event.get('adapter') or 'no file'}{kept}"
    if kind in ("error", "log"):
        return f"{kind}: {event.get('message')}"
    return None


class EventWriter:
    def __init__(self, path: str | Path, enabled: bool = True, echo: bool = False):
        """`echo`: each event also printed as one line on stderr (the standalone trainer's progress)."""
        self.path = Path(path)
        self.enabled = enabled
        self.echo = echo
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None
        # The watchdog thread writes too: one line at a time, and nothing after the line that ends the run.
        self._lock = threading.Lock()
        self._sealed = False

    def emit(self, type_: str, last: bool = False, **fields) -> dict:
        """`last`: this event ends the stream; the training thread's later events are dropped (its process is
        about to exit), so a reader never sees a step after the error that ended the run."""
        if type_ not in EVENT_TYPES:
            raise ValueError(f"unknown event type {type_!r}")
        event = json_safe({"v": EVENT_VERSION, "type": type_, "time": round(time.time(), 3), **fields})
        with self._lock:
            if self._sealed:
                return event
            self._sealed = last
            if self._file is not None:
                self._file.write(json.dumps(event, allow_nan=False) + "\n")
                self._file.flush()  # readers (the runner, a second server) see it now; a killed trainer loses nothing
                if type_ != "step":  # durable through a power cut too; a step a second is not worth a disk flush
                    os.fsync(self._file.fileno())  # each (milliseconds on some Windows disks)
        if self.echo:
            import sys
            line = event_line(event)
            if line:
                print(line, file=sys.stderr, flush=True)
        return event

    def close(self):
        with self._lock:  # the watchdog may be writing
            if self._file is not None:
                self._file.close()
                self._file = None


class EventReader:
    """Incremental reader: each poll returns the complete lines added since the last one."""

    def __init__(self, path: str | Path, from_end: bool = False):
        """`from_end`: skip what the file holds already (a resumed run appends to its old events)."""
        self.path = Path(path)
        self._offset = self.path.stat().st_size if from_end and self.path.exists() else 0
        self._partial = b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for the next poll
        events = []
        for line in lines:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
                continue
            if isinstance(event, dict) and event.get("type") in EVENT_TYPES:
                events.append(event)
        return events


def read_events(path: str | Path, since: int = 0) -> list[dict]:
    """All events in a run's event file from index `since` on."""
    return EventReader(path).poll()[since:]
