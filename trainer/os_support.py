"""Every operating-system call whose form differs between Linux (or macOS) and Windows, decided here and nowhere
else: process groups and killing a run's whole process tree, whether a process is still there, the standby's
hand-off channel, replacing a file atomically, paths Windows cannot open, and flushing C's output before the
trainer leaves without the interpreter's teardown. Each decision reads `os.name` when called (tests fake it)."""
from __future__ import annotations

import os
import time

WINDOWS_MAX_PATH = 260  # MAX_PATH, the trailing NUL included, unless the machine enabled long paths
REPLACE_RETRY_S = 2.0  # how long a Windows sharing violation (an antivirus or indexer holding the file) is retried


def windows() -> bool:
    return os.name == "nt"


def own_process_group() -> dict:
    """Popen arguments that start a process leading its own group, so that the run's tree can be stopped alone."""
    if windows():
        import subprocess
        return {"creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0x200)}
    return {"start_new_session": True}


def signal_tree(pid: int, force: bool) -> None:
    """Asks the process tree led by `pid` to stop (`force`: kills it). POSIX: a signal to its process group (every
    process of the run, workers of a multi-process run included). Windows, which has neither process groups in
    that sense nor SIGKILL: psutil's walk of its children, terminated (TerminateProcess) children first."""
    if windows():
        import psutil  # a ComfyUI requirement
        try:
            leader = psutil.Process(pid)
            tree = leader.children(recursive=True) + [leader]
        except psutil.NoSuchProcess:
            return
        for process in tree:
            try:
                process.kill() if force else process.terminate()
            except psutil.NoSuchProcess:
                pass
        return
    import signal
    try:
        os.killpg(pid, signal.SIGKILL if force else signal.SIGTERM)
    except ProcessLookupError:
        pass


def tree_of(pid: int) -> list:
    """The processes of the tree led by `pid`, to kill once the leader is gone (Windows: found through the leader,
    so they must be listed before it ends); POSIX: none, its process group outlives the leader."""
    if not windows():
        return []
    import psutil
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_processes(processes: list) -> None:
    """Kills tree_of's processes still running (psutil refuses a pid since reused by another process)."""
    if not processes:
        return
    import psutil
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def usable_cpus() -> int:
    """The CPU cores this process may run on (its affinity and cgroup set, where the system says; else all)."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return len(os.sched_getaffinity(0)) or 1
        except OSError:
            pass
    return os.cpu_count() or 1


def host_memory() -> tuple[int | None, int | None]:
    """(resident bytes now, the process's peak so far): Linux's VmRSS and VmHWM, Windows' working set and peak
    working set (psutil); None for what the system does not tell."""
    if windows():
        import psutil
        info = psutil.Process().memory_info()
        return info.rss, getattr(info, "peak_wset", None)
    found = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    found[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return found.get("VmRSS"), found.get("VmHWM")


def available_memory() -> int | None:
    """RAM the system can give without swapping (Linux's MemAvailable, Windows' available physical memory)."""
    try:
        import psutil  # a ComfyUI requirement
        return int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        return None


def total_memory() -> int | None:
    """The machine's physical RAM."""
    try:
        import psutil  # a ComfyUI requirement
        return int(psutil.virtual_memory().total)
    except (ImportError, OSError):
        return None


def restart_memory_peak() -> None:
    """Restarts host_memory's peak where the system allows it (Linux: clear_refs 5)."""
    if windows():
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
M_TRIM_THRESHOLD = -1


def map_large_allocations(threshold: int) -> bool:
    """Where glibc is the allocator: allocations of `threshold` bytes and more get their own memory mapping, given
    back to the system when freed, instead of the heap, whose freed pages stay resident (glibc raises its threshold
    up to 32 MiB as tensors are freed, so weights land on the heap). Fixes the threshold for the process's life; False
    where it could not (not glibc)."""
    if windows():
        return False
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        # a fixed threshold also fixes the trim threshold (glibc's moving one keeps it at twice the threshold): kept
        # above it, so freed blocks at the heap's top are not given back and faulted in again every step
        libc.mallopt(M_TRIM_THRESHOLD, 2 * int(threshold))
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


def standby_supported() -> bool:
    """The standby hands its run over a Unix socket with the log's descriptor attached (send_fds): POSIX only.
    Elsewhere every run starts its own process, as multi-process runs always do."""
    import socket
    return not windows() and hasattr(socket, "AF_UNIX") and hasattr(socket, "send_fds")


def replace_file(source, target) -> None:
    """os.replace; on Windows retried for a while when another process holds the target open without sharing
    (antivirus scanners and indexers do, briefly), which POSIX never refuses."""
    deadline = time.monotonic() + REPLACE_RETRY_S
    while True:
        try:
            os.replace(source, target)
            return
        except PermissionError:
            if not windows() or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def path_problem(path) -> str | None:
    """Why Windows could not open this path (over MAX_PATH characters), naming it; None where it can."""
    text = os.path.abspath(str(path))
    if windows() and len(text) >= WINDOWS_MAX_PATH and not text.startswith("\\\\?\\"):
        return (f"{text} is {len(text)} characters long, over Windows' limit of {WINDOWS_MAX_PATH - 1}: choose a "
                "shorter output name or folder, or enable long paths in Windows")
    return None


def process_started(pid: int) -> float | None:
    """When `pid` started (psutil's create_time), to tell it from a later process given the same pid; None where
    it is gone or cannot be asked."""
    import psutil  # a ComfyUI requirement
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def process_gone(pid: int, started: float | None = None) -> bool:
    """True when `pid` no longer runs: it does not exist, it was killed and is not yet reaped (a zombie), or, with
    `started` (process_started's answer while it ran), the pid now belongs to a process started since (Windows
    hands pids out again quickly, and its os.getppid() keeps naming a parent that is gone)."""
    if started is not None:
        now = process_started(pid)
        if now is not None and abs(now - started) > 1e-3:
            return True
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
