"""Start the trainer in its own process group, read its events, stop it without leaving orphans."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..trainer.run.events import EventReader
from ..trainer.os_support import kill_processes, own_process_group, signal_tree, tree_of, usable_cpus
from ..trainer.run.layout import EVENTS_FILE, LOG_FILE, PID_FILE, STOP_FILE

PACK_ROOT = Path(__file__).resolve().parent.parent


class TrainerProcess:
    def __init__(self, run_dir: str | Path, spec_path: str | Path, python: str = sys.executable,
                 comfyui_path: str | None = None, resume: str | None = None, watch_parent: bool = True,
                 processes: int = 1, hostfile: str = "", prime_beside: bool = False):
        """`prime_beside`: the next standby starts with this run, not after it (an evaluation: short, and often
        followed by a Train node in the same prompt, whose hand-off then finds a warm standby)."""
        self.run_dir = Path(run_dir)
        self.spec_path = Path(spec_path)
        self.python = python
        self.comfyui_path = comfyui_path
        self.resume = resume
        self.watch_parent = watch_parent
        self.processes = processes
        self.hostfile = hostfile
        self.prime_beside = prime_beside
        self.proc: subprocess.Popen | None = None
        self.events = EventReader(self.run_dir / EVENTS_FILE)
        self.log_path = self.run_dir / LOG_FILE
        self.standby = False  # whether a standby trainer took the run (runner/standby.py)
        self._prime_when_done: tuple | None = None  # (python, env) of the standby to start once this run ends
        self.started_at = 0.0  # time.time() at start()

    @property
    def multi_process(self) -> bool:
        """Started through the DeepSpeed launcher (never by a standby)."""
        return self.processes > 1 or bool(self.hostfile)

    def command(self) -> list[str]:
        cmd = [self.python, str(PACK_ROOT / "trainer"), "--config", str(self.spec_path)]
        if self.multi_process:
            cmd = deepspeed_launch_command(self.python, self.processes, self.hostfile) + \
                [str(PACK_ROOT / "trainer" / "__main__.py"), *cmd[2:]]
        cmd += ["--signed-run"]  # prepare_run signed the folder; the trainer checks the bytes it reads
        if self.resume:
            cmd += ["--resume", self.resume]
        if self.watch_parent:
            import socket
            cmd += ["--parent-pid", str(os.getpid()), "--parent-host", socket.gethostname()]
        return cmd

    def start(self) -> "TrainerProcess":
        import time
        from . import standby
        self.started_at = time.time()
        self.events = EventReader(self.run_dir / EVENTS_FILE, from_end=True)
        env = standby.trainer_environment(self.comfyui_path)
        cmd = self.command()
        single = not self.multi_process
        with open(self.log_path, "ab") as log:
            ready = standby.take(self.python, env) if single else None
            if not single:
                standby.run_started()
            if ready is not None and ready.hand_off(cmd[2:], log.fileno()):  # same argv, minus python and script
                self.proc, self.standby = ready.proc, True
            else:
                # own session: a signal to the group reaches every process of the run and nothing else
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             cwd=PACK_ROOT, env=env, **own_process_group())
        (self.run_dir / PID_FILE).write_text(str(self.proc.pid))
        # the next standby starts once this run's training is over (its last step, or a Stop), not beside it: its
        # ComfyUI import opens a CUDA context, memory the training steps would lose; the final evaluation and the
        # export leave it time to warm, so a run queued right after finds it ready (a training prompt queued
        # meanwhile starts one through the prompt hook)
        self._prime_when_done = (self.python, env) if single and not self.prime_beside else None
        if single and self.prime_beside:
            standby.prime(self.python, env)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None:
            self._prime_next()
        return rc

    def poll_events(self) -> list[dict]:
        events = self.events.poll()
        if self._prime_when_done and (any(e.get("type") == "step" and e.get("step") == e.get("total") for e in events)
                                      or self._stop_asked()):
            self._prime_next()
        return events

    def _stop_asked(self) -> bool:
        """A STOP written since this run started (one left from before is not a request to it: the trainer drops it)."""
        try:
            return (self.run_dir / STOP_FILE).stat().st_mtime >= self.started_at
        except OSError:
            return False

    def _prime_next(self):
        """The standby for the next run in the queue, once per run."""
        if self._prime_when_done:
            from . import standby
            python, env = self._prime_when_done
            self._prime_when_done = None
            standby.prime(python, env)

    def terminate(self, grace_s: float = 2.0) -> int:
        """Asks the run's whole process tree to stop, kills it after `grace_s`; returns once the leader is reaped
        (os_support.signal_tree: the process group on POSIX, psutil's walk of the tree on Windows)."""
        if self.proc is None:
            return 0
        for force, wait_s in ((False, grace_s), (True, 5.0)):
            stragglers = tree_of(self.proc.pid)  # on Windows the children cannot be found once the leader is gone
            signal_tree(self.proc.pid, force)
            try:
                self.proc.wait(timeout=wait_s)
                kill_processes(stragglers)  # workers of a multi-process run may outlive the leader
                signal_tree(self.proc.pid, True)
                break
            except subprocess.TimeoutExpired:
                continue
        self._prime_next()  # cancelled: the next prompt in the queue finds a standby
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def check_local_processes(processes: int) -> list[str]:
    """The GPUs a run of `processes` ranks on this machine takes (this ComfyUI's CUDA_VISIBLE_DEVICES, [] where
    unset); more ranks than the machine's GPUs (or, without a GPU, its CPU cores) are refused naming
    distributed.processes: any client can queue a graph, and each rank is a whole trainer process."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible:
        if len(visible) < processes:
            raise ValueError(f"distributed.processes: {processes} processes, but this ComfyUI sees {len(visible)} "
                             f"GPU(s) (CUDA_VISIBLE_DEVICES={','.join(visible)})")
        return visible
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    limit, what = (gpus, "GPU(s)") if gpus else (usable_cpus(), "CPU cores and no GPU")
    if processes > limit:
        raise ValueError(f"distributed.processes: {processes} processes, but this machine has {limit} {what}; "
                         f"at most {limit} (several machines: give a hostfile)")
    return []


def deepspeed_launch_command(python: str, processes: int, hostfile: str = "", master_port: int | None = None):
    """The `deepspeed` launcher (the same command a user runs on a cluster), as a module of this Python."""
    import socket
    if master_port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            master_port = s.getsockname()[1]
    cmd = [python, "-m", "deepspeed.launcher.runner", "--master_port", str(master_port)]
    if hostfile:
        return cmd + ["--hostfile", hostfile]
    # the GPUs this ComfyUI was given (CUDA_VISIBLE_DEVICES, which its --cuda-device sets): DeepSpeed's runner drops
    # the variable when given --num_gpus and would train on GPUs 0..N-1 instead
    visible = check_local_processes(processes)
    gpus = ["--include", "localhost:" + ",".join(visible[:processes])] if visible else ["--num_gpus", str(processes)]
    return cmd + gpus + ["--master_addr", "127.0.0.1"]

