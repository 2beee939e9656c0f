"""A trainer process started ahead of need: `python <pack>/trainer --standby --parent-pid P`.

It does the imports every run needs (torch, the launching server's ComfyUI, DeepSpeed, peft, the training
loop) and then waits on its stdin, a Unix socket from the launcher, for the trainer's command line (a JSON line
holding a list) with the run's log file as an attached descriptor. Before it, the launcher may send the queued
run's model (a JSON line `{"preload": ...}`), which it loads while the graph's earlier nodes run; the run takes it
if its spec names the same files, loaded the same way (trainer/models load_key), else it is dropped.
It moves its output (what the imports printed, kept in a launcher-made unnamed file) into the run's log, points
stdout/stderr at that log and stdin at /dev/null, and runs `main(argv)` exactly as a freshly started trainer
would: same argv, same events, same exit code.

Unassigned, it exits when the launcher closes its end of the socket or exits, when the process `--parent-pid`
names is gone (a fork of the launcher may hold the socket open), or after `--idle-s` seconds.
"""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time

EXIT_ORPHANED = 3  # as trainer.main's: the launcher is gone
MAX_MESSAGE = 1 << 20
READY = b"ready\n"  # sent once the imports are done (the launcher may wait for it; it need not)


def warm_up() -> None:
    """The imports of every one-process run, in the order a run does them; bitsandbytes stays hidden (see
    main.py), and so does DeepSpeed: a one-process run trains without it (plain_engine.py), and the rare one that
    needs it (ZeRO or optimizer offload in one process) imports it itself. A launcher gone meanwhile ends the
    process (OrphanWatch), whichever import is running."""
    import torch  # noqa: F401
    from ..comfy_env import import_comfy
    import_comfy()  # COMFYUI_PATH is the launching server's, set in this process's environment
    import peft  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401  the health log's writer
    from . import evaluation, loop
    from ..parallel import hostfile, plain_engine
    from .. import objectives, training_module  # noqa: F401


PRELOAD_KEEP_S = 600.0  # a preloaded model whose run has not come by then (its prompt failed, say) is dropped


def wait_for_command(channel: socket.socket, idle_s: float, on_message=lambda: None, on_preload=None,
                     launcher_gone=lambda: False, on_preload_expired=lambda: None,
                     preload_keep_s: float = PRELOAD_KEEP_S) -> tuple[list[str], int] | None:
    """(argv, log descriptor) from the launcher, or None when the launcher closed its end, is gone, or the wait ran
    out. Messages are JSON lines: a `{"preload": ...}` asks for the queued run's model ahead of it
    (`on_preload(payload)`, done at once unless the run is there already); a list is the run's command line, sent
    with the log's descriptor. `on_message()` runs once something is there to read, before it is read (a run sent
    is the run's from then; OrphanWatch's watch stops, so from a preload on this loop watches `launcher_gone`). A
    preload whose run has not come within `preload_keep_s` is let go (`on_preload_expired()`)."""
    deadline = time.monotonic() + idle_s
    buffer, fds, watching, preload_until = b"", [], False, None
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            message = json.loads(line)
            if isinstance(message, dict) and "preload" in message:
                if on_preload is not None and b"\n" not in buffer:  # with the run already there: the run loads it
                    on_preload(message["preload"])
                    # held that long, and a run sent while it loaded (minutes, for a big model) is still read
                    preload_until = time.monotonic() + preload_keep_s
                    deadline = max(deadline, preload_until + 1.0)
                watching = True
                continue
            if len(fds) != 1:
                raise RuntimeError(f"standby: the launcher's run came with {len(fds)} descriptors, not the run's log")
            if not (isinstance(message, list) and all(isinstance(a, str) for a in message)) or "--standby" in message:
                raise RuntimeError("standby: the launcher's message is not a trainer command line")
            return message, fds[0]
        now = time.monotonic()
        if now >= deadline or (watching and launcher_gone()):
            return None
        if preload_until is not None and now >= preload_until:
            on_preload_expired()
            preload_until = None
        ready, _, _ = select.select([channel], [], [], min(deadline - now, 0.2) if watching else deadline - now)
        if not ready:
            continue
        on_message()
        data, received, _, _ = socket.recv_fds(channel, MAX_MESSAGE, 1)
        fds += received
        if not data:  # the launcher closed the socket (or exited)
            for fd in fds:
                os.close(fd)
            return None
        buffer += data


def preload(payload: dict) -> None:
    """The queued run's base model, loaded ahead of it (models.preload_base_model): `payload` is the model
    section of its spec and its precision, as the launcher read them from the queued prompt. What fails here is
    only logged: the run then loads the model itself and reports what is wrong."""
    began = time.perf_counter()
    try:
        from ..device import choose_device, concrete_precision
        from ..models import preload_base_model
        from ..spec import ModelSpec
        choose_device()
        model = ModelSpec(**payload["model"])
        preload_base_model(model, concrete_precision(payload["precision"]))
        print(f"ingraph-trainer: standby loaded {model.path} ahead of its run in {time.perf_counter() - began:.1f} s",
              flush=True)
    except Exception as exc:  # noqa: BLE001 - a preload is a guess; the run is the judge
        print(f"ingraph-trainer: standby did not load the queued run's model ahead of it ({type(exc).__name__}: "
              f"{exc})", flush=True)


def drop_preload() -> None:
    from ..models import drop_preloaded
    drop_preloaded()
    print("ingraph-trainer: standby let go of the model it loaded ahead of a run that has not come", flush=True)


def take_over_output(log_fd: int):
    """What this process printed so far goes to the run's log, and so does everything from now on."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        size = os.fstat(1).st_size
        offset = 0
        while offset < size:  # fd 1 is the unnamed file the launcher opened read-write for this process
            chunk = os.pread(1, min(1 << 20, size - offset), offset)
            if not chunk:
                break
            os.write(log_fd, chunk)
            offset += len(chunk)
    except OSError:
        pass  # output that cannot be read back (stdout is not a file) is not worth failing a run for
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


class OrphanWatch:
    """Ends the standby within `every_s` of its launcher's end, even in the middle of an import step (torch's or
    ComfyUI's take seconds each, and a main job or a test that stopped its server wants no process of its left),
    until `taken()`: from then on the run is the trainer's, which has its own orphan handling and final events."""

    def __init__(self, parent_pid: int, every_s: float = 0.2):
        self.parent_pid, self.every_s = parent_pid, every_s
        self.lock = threading.Lock()
        self.run_taken = False
        if parent_pid > 0:
            threading.Thread(target=self.watch, daemon=True, name="standby-orphan-watch").start()

    def watch(self):
        while True:
            time.sleep(self.every_s)
            with self.lock:  # taken() waits for a check in progress: a run is never cut off once it is taken
                if self.run_taken:
                    return
                if _parent_gone(self.parent_pid):
                    os._exit(EXIT_ORPHANED)

    def taken(self):
        with self.lock:
            self.run_taken = True


def serve(argv: list[str], run_main) -> int:
    """The standby's life: warm up, wait for one command, become that trainer. Returns its exit code."""
    import argparse
    parser = argparse.ArgumentParser(prog="ingraph-trainer --standby")
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--idle-s", type=float, default=900.0)
    opts = parser.parse_args(argv)
    channel = socket.socket(fileno=os.dup(0))
    # a launcher gone already (a main job that ended, a server stopped) wants no standby: no seconds of imports;
    # one gone later ends the process from the watch, whatever it is doing, until a run is there to read
    if opts.parent_pid > 0 and _parent_gone(opts.parent_pid):
        return EXIT_ORPHANED
    orphan_watch = OrphanWatch(opts.parent_pid)
    warm_up()
    try:
        channel.sendall(READY)
    except OSError:
        pass  # the launcher sent the run before the imports were done and closed its end: the run is still there
    warm_at = time.strftime("%H:%M:%S")
    # a run sent and then its launcher gone: the run is the trainer's to end (its orphan handling writes the last
    # event), so the watch stops as soon as a message is there to read
    command = wait_for_command(channel, opts.idle_s, on_message=orphan_watch.taken, on_preload=preload,
                               launcher_gone=lambda: opts.parent_pid > 0 and _parent_gone(opts.parent_pid),
                               on_preload_expired=drop_preload)
    if command is None:
        return 0 if opts.parent_pid <= 0 or not _parent_gone(opts.parent_pid) else EXIT_ORPHANED
    run_argv, log_fd = command
    take_over_output(log_fd)
    channel.close()
    print(f"ingraph-trainer: standby process {os.getpid()} (imports done at {warm_at}) takes this run", flush=True)
    from ..run.stop_requests import mark_run_start
    mark_run_start()  # a STOP written before this moment (the previous run's, in a resumed run's folder) is stale
    sys.argv[1:] = run_argv
    return run_main(run_argv)


def _parent_gone(parent_pid: int) -> bool:
    from ..os_support import process_gone
    return os.getppid() != parent_pid or process_gone(parent_pid)
