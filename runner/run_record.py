"""A run's record (state, progress, artifacts), folded from its events file and kept up to date incrementally.

A listing costs the number of runs, not the number of events: each run keeps a small summary, and a later
look reads only the bytes appended since the last one. Everything under ComfyUI's output folder may have been
written by a client (stock ComfyUI lets any client upload there), so every read is bounded, symlinks and
special files are refused, and a line or field that is not what the trainer writes is skipped.

The record follows the newest run in the folder: a resumed run appends a new `started` event to the same
file, and state, step, total and adapter come from the events after it. Checkpoints, samples and the best
evaluation belong to the whole run folder.
"""
from __future__ import annotations

import json
import math
import os
import stat
import threading
import time
from collections import deque
from pathlib import Path

from ..trainer.run.events import EVENT_TYPES
from ..trainer.run.layout import CHECKPOINTS_DIR, EVENTS_FILE, OWNER_FILE, PID_FILE
from ..trainer.os_support import process_gone

TERMINAL = {"finished": "finished", "error": "failed"}
INDEX_EVERY = 1024  # the byte offset of every 1024th event: a page of events is read without the lines before it
READ_CHUNK = 4 << 20
MAX_LINE = 1 << 20  # a longer line is not an event the trainer wrote: skipped unread
TAIL_BYTES = 64  # the bytes before the folded offset, to notice a file rewritten in place
SAMPLES_LISTED = 256  # the newest preview images a record lists
YIELD_EVERY = 512  # lines folded between two GIL releases, so ComfyUI's event loop answers meanwhile
MAX_PID = 2 ** 31
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def open_regular_file(path: Path):
    """A binary file object for `path`, or None when it is missing, a symlink, or not a regular file
    (a FIFO planted as events.jsonl must not block a reader forever)."""
    try:
        if not hasattr(os, "O_NOFOLLOW") and os.path.islink(path):  # no O_NOFOLLOW (Windows): check first
            return None
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return os.fdopen(fd, "rb")
    except OSError:
        os.close(fd)
        return None


def read_small_file(path: Path, limit: int = 4096) -> tuple[bytes, os.stat_result] | None:
    """(contents, stat) of a regular file of at most `limit` bytes; None otherwise."""
    f = open_regular_file(path)
    if f is None:
        return None
    with f:
        try:
            data, st = f.read(limit + 1), os.fstat(f.fileno())
        except OSError:
            return None
    return (data, st) if len(data) <= limit else None


def parse_event(line: bytes) -> dict | None:
    """One line of an events file as the trainer's EventReader sees it: a JSON object of a known type."""
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
        return None
    if isinstance(event, dict) and isinstance(event.get("type"), str) and event["type"] in EVENT_TYPES:
        return event
    return None


def _count(value) -> int | None:
    """A step number or total: a non-negative int (JSON true is not one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _finite(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def json_dumps(data) -> str:
    """JSON a browser can parse: NaN and infinities (a tolerated event field) become null."""
    try:
        return json.dumps(data, allow_nan=False)
    except ValueError:
        return json.dumps(_without_non_finite(data), allow_nan=False)


def _without_non_finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _without_non_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_non_finite(v) for v in value]
    return value


class EventsSummary:
    """What a record needs from one events file, folded event by event; `update` reads only appended bytes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bytes_read = 0  # all updates together (tests check what they cost)
        self.reset()
        self.checkpoints_key = None
        self.checkpoints: list[str] = []

    def reset(self):
        self.identity = None  # (st_dev, st_ino) of the file folded so far
        self.seen = None  # (size, mtime_ns) at the last update
        self.offset = 0  # bytes folded: complete lines only
        self.tail = b""
        self.skipping = False  # inside a line longer than MAX_LINE
        self.count = 0
        self.index = [0]  # index[i]: byte offset of event number i * INDEX_EVERY
        self.last_event = None
        self.samples: deque[str] = deque(maxlen=SAMPLES_LISTED)
        self.samples_total = 0
        self.best_eval = None  # (loss, step): the lowest loss, the earliest step on a tie
        self.started = None  # the newest run in the folder begins at its `started` event
        self.last_step = None  # (step, total) of the newest run's last step event
        self.terminal = None  # the newest run's finished or error event

    def fold(self, event: dict, line_offset: int):
        if self.count and self.count % INDEX_EVERY == 0:
            self.index.append(line_offset)
        self.count += 1
        self.last_event = event
        kind = event["type"]
        if kind == "started":
            self.started, self.last_step, self.terminal = event, None, None
        elif kind == "step":
            step = _count(event.get("step"))
            if step is not None:
                self.last_step = (step, _count(event.get("total")))
        elif kind == "eval":
            step, loss = _count(event.get("step")), _finite(event.get("loss"))
            if step is not None and loss is not None and (self.best_eval is None or (loss, step) < self.best_eval):
                self.best_eval = (loss, step)
        elif kind == "sample":
            images = event.get("images")
            if isinstance(images, list):
                for image in images:
                    if isinstance(image, str):
                        self.samples.append(image)
                        self.samples_total += 1
        elif kind in TERMINAL:
            self.terminal = event

    def update(self, path: Path):
        """Folds what was appended to `path` since the last update; starts over when it is another file."""
        f = open_regular_file(path)
        if f is None:
            self.reset()
            return
        with f:
            st = os.fstat(f.fileno())
            identity = (st.st_dev, st.st_ino)
            if identity == self.identity and (st.st_size, st.st_mtime_ns) == self.seen:
                return
            if identity != self.identity or st.st_size < self.offset or not self._tail_matches(f):
                self.reset()
                self.identity = identity
            self._fold_bytes(f, st.st_size)
            self.seen = (st.st_size, st.st_mtime_ns)
            f.seek(max(0, self.offset - TAIL_BYTES))
            self.tail = f.read(self.offset - max(0, self.offset - TAIL_BYTES))

    def _tail_matches(self, f) -> bool:
        if not self.offset:
            return True
        f.seek(self.offset - len(self.tail))
        return f.read(len(self.tail)) == self.tail

    def _fold_bytes(self, f, end: int):
        lines = _Lines(self.offset, self.skipping)
        for number, (line_offset, line) in enumerate(lines.read(f, end), 1):
            event = parse_event(line)
            if event is not None:
                self.fold(event, line_offset)
            if number % YIELD_EVERY == 0:
                time.sleep(0.0002)  # let the server's event loop have the interpreter
        self.offset, self.skipping = lines.position, lines.skipping
        self.bytes_read += lines.bytes_read

    def events_page(self, path: Path, since: int, limit: int) -> list[dict]:
        """Events number `since` .. since + limit - 1 as of the last update, read from the nearest index mark."""
        mark = min(min(since, self.count) // INDEX_EVERY, len(self.index) - 1)
        number, out = mark * INDEX_EVERY, []
        f = open_regular_file(path) if limit > 0 and since < self.count else None
        if f is None:
            return out
        with f:
            for _, line in _Lines(self.index[mark], False).read(f, self.offset):
                event = parse_event(line)
                if event is None:
                    continue
                if number >= since:
                    out.append(event)
                    if len(out) >= limit:
                        break
                number += 1
        return out


class _Lines:
    """The complete lines of a file region, with their offsets; lines over MAX_LINE are skipped unread."""

    def __init__(self, position: int, skipping: bool):
        self.position, self.skipping, self.bytes_read = position, skipping, 0

    def read(self, f, end: int):
        f.seek(self.position)
        pending = b""
        while self.position + len(pending) < end:
            chunk = f.read(min(READ_CHUNK, end - self.position - len(pending)))
            if not chunk:
                break
            self.bytes_read += len(chunk)
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()  # an incomplete last line waits for the next read
            for line in lines:
                line_offset = self.position
                self.position += len(line) + 1
                if self.skipping:  # the end of an over-long line
                    self.skipping = False
                elif line.strip() and len(line) <= MAX_LINE:
                    yield line_offset, line
            if len(pending) > MAX_LINE:
                self.position += len(pending)
                pending, self.skipping = b"", True


def _trainer_pid(run_dir: Path) -> tuple[int, float] | None:
    """(pid, time written) from trainer.pid; None when it is missing or not a plausible pid."""
    found = read_small_file(run_dir / PID_FILE, 32)
    if found is None:
        return None
    try:
        pid = int(found[0].decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return (pid, found[1].st_mtime) if 0 < pid < MAX_PID else None  # -1 or 0 would address many processes


def trainer_running(run_dir: Path) -> bool:
    """Is the trainer last launched for this run still alive (on this machine)?"""
    pid = _trainer_pid(Path(run_dir))
    return pid is not None and not process_gone(pid[0])


def _read_owner(run_dir: Path) -> str | None:
    """The graph node that started the run (owner.json), or None when the file is missing or damaged."""
    found = read_small_file(run_dir / OWNER_FILE)
    if found is None:
        return None
    try:
        node = json.loads(found[0]).get("node")
    except (ValueError, AttributeError, RecursionError):
        return None
    return str(node) if isinstance(node, (str, int)) and not isinstance(node, bool) else None


def _checkpoints(run_dir: Path, summary: EventsSummary) -> list[str]:
    """Complete checkpoint tags, recomputed only when the checkpoints folder or one of its entries changed."""
    from .runs import complete_checkpoints
    try:
        with os.scandir(run_dir / CHECKPOINTS_DIR) as entries:
            key = tuple(sorted((e.name, e.stat(follow_symlinks=False).st_mtime_ns) for e in entries))
    except OSError:
        return []
    if key != summary.checkpoints_key:
        summary.checkpoints, summary.checkpoints_key = complete_checkpoints(run_dir), key
    return summary.checkpoints


class RunRecords:
    """The summaries of the runs seen so far, one per run folder."""

    def __init__(self):
        self._lock = threading.Lock()
        self._summaries: dict[str, EventsSummary] = {}

    def summary(self, run_dir: Path) -> EventsSummary:
        with self._lock:
            summary = self._summaries.setdefault(str(run_dir), EventsSummary())
        return summary

    def record(self, run_dir: Path) -> dict:
        summary = self.summary(run_dir)
        with summary.lock:
            summary.update(run_dir / EVENTS_FILE)
            return _record(run_dir, summary)

    def events(self, run_dir: Path, since: int, limit: int) -> tuple[list[dict], int]:
        """(events number since .. since + limit - 1, how many the file holds)."""
        summary = self.summary(run_dir)
        with summary.lock:
            summary.update(run_dir / EVENTS_FILE)
            return summary.events_page(run_dir / EVENTS_FILE, since, limit), summary.count

    def listing(self, runs_root: Path) -> list[dict]:
        """Records of every run folder, newest first (run ids begin with their start time)."""
        from .runs import valid_run_id
        runs_root = Path(runs_root).resolve()  # the same summary key as a run looked up by id
        try:
            with os.scandir(runs_root) as entries:
                dirs = sorted((e.name for e in entries if valid_run_id(e.name) and e.is_dir(follow_symlinks=False)),
                              reverse=True)
        except OSError:
            return []
        records = [self.record(Path(runs_root) / name) for name in dirs]
        with self._lock:  # forget runs that were deleted
            keep = {str(Path(runs_root) / name) for name in dirs}
            for key in [k for k in self._summaries if Path(k).parent == Path(runs_root) and k not in keep]:
                del self._summaries[key]
        return records


def _record(run_dir: Path, summary: EventsSummary) -> dict:
    terminal, started = summary.terminal, summary.started
    pid = _trainer_pid(run_dir)
    alive = pid is not None and not process_gone(pid[0])
    if terminal is not None:
        ended_at = _finite(terminal.get("time"))
        relaunched = alive and ended_at is not None and pid[1] > ended_at  # resumed, not yet started
        if relaunched:
            state = "running"
        else:
            state = "stopped" if terminal.get("stopped") is True else TERMINAL[terminal["type"]]
    elif alive:
        state = "running"
    else:
        state = "interrupted" if summary.count else "pending"
    if summary.last_step is not None:
        step, total = summary.last_step
    else:
        step = (_count(started.get("start_step")) or 0) if started else 0
        total = _count(started.get("total")) if started else None
    adapter = terminal.get("adapter") if terminal else None
    best = summary.best_eval
    return {
        "id": run_dir.name, "node": _read_owner(run_dir), "state": state, "last_event": summary.last_event,
        "events": summary.count, "step": step, "total": total,
        "artifacts": {
            "adapter": adapter if isinstance(adapter, str) else None,
            "checkpoints": _checkpoints(run_dir, summary),
            "samples": list(summary.samples), "samples_total": summary.samples_total,
        },
        "best_eval": {"step": best[1], "loss": best[0]} if best else None,
    }


RECORDS = RunRecords()
