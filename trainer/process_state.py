"""Is a process still there? Shared by the trainer's parent watchdog and the run-record routes. And how the trainer
flushes what C libraries printed before it leaves without the interpreter's teardown."""
from __future__ import annotations

import os


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs: it does not exist, or it was killed and is not yet reaped (a zombie)."""
    if os.name == "nt":  # there os.kill(pid, 0) would send CTRL_C_EVENT, not probe
        import psutil  # a ComfyUI requirement
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] == "Z"
    except OSError:
        return False


def flush_c_stdio() -> None:
    """Flushes C's stdio buffers (what C and C++ libraries printed into the run's log), where the C library is
    reachable: `ctypes.CDLL(None)` is the running process's own symbols on POSIX and raises TypeError on Windows,
    whose C runtime the interpreter's own flush already covers. Never raises: a run that succeeded stays a success
    (on Windows every successful run exited 1 here)."""
    if os.name == "nt":
        return
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):
        pass
