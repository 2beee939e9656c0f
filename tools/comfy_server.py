"""Start a real ComfyUI server headless with this pack installed, for tests, benchmarks and the main job."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def comfyui_path() -> Path:
    return Path(os.environ.get("COMFYUI_PATH", "/opt/ComfyUI"))


def comfyui_available() -> bool:
    return (comfyui_path() / "main.py").is_file() and (comfyui_path() / "comfy").is_dir()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """ComfyUI in its own process group, with a base directory of its own (models, input, output)."""

    def __init__(self, base_dir: str | Path, *, port: int | None = None, python: str = sys.executable,
                 pack_name: str = "InGraph-Trainer", with_pack: bool = True, extra_args: tuple = (),
                 extra_env: dict | None = None, cpu: bool = True):
        self.base_dir = Path(base_dir)
        self.port = port or free_port()
        self.python = python
        self.pack_name = pack_name
        self.with_pack = with_pack
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.cpu = cpu  # --cpu: the suite's servers never take a GPU; bench/gpu.py's does
        self.proc: subprocess.Popen | None = None
        self.log_path = self.base_dir / "comfyui.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def dir(self, *parts) -> Path:
        path = self.base_dir.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def command(self) -> list[str]:
        return [self.python, str(comfyui_path() / "main.py"), *(["--cpu"] if self.cpu else []), "--listen", "127.0.0.1", "--port", str(self.port),
                "--disable-auto-launch", "--disable-api-nodes", "--database-url", "sqlite:///:memory:",
                "--base-directory", str(self.base_dir), *self.extra_args]

    def start(self, timeout: float = 120.0) -> "ComfyServer":
        for sub in ("models/checkpoints", "models/loras", "input", "output", "custom_nodes", "user", "temp"):
            self.dir(sub)
        link = self.base_dir / "custom_nodes" / self.pack_name
        if self.with_pack and not link.exists():
            link.symlink_to(REPO, target_is_directory=True)
        if not self.with_pack and link.is_symlink():
            link.unlink()
        env = dict(os.environ, PYTHONUNBUFFERED="1", COMFYUI_PATH=str(comfyui_path()), **self.extra_env)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=str(comfyui_path()), env=env, start_new_session=True)
        log.close()
        return self

    def wait_ready(self, timeout: float = 120.0):
        import urllib.request
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(f"http://{self.address}/object_info/CheckpointLoaderSimple", timeout=2).read()
                return self
            except OSError:
                time.sleep(0.25)
        raise TimeoutError(f"ComfyUI not ready after {timeout} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0):
        """Stops the server and every process it started: its standby and trainer processes lead process groups
        of their own and notice on their own that the server is gone (a trainer then writes its last event);
        what is left after `grace_s` is killed, so nothing of the server outlives this call."""
        if self.proc is None or self.proc.poll() is not None:
            return
        import psutil  # a ComfyUI requirement
        try:
            started = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        _, left = psutil.wait_procs(started, timeout=grace_s)
        for process in left:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=10.0)

    def log_text(self) -> str:
        """The server's log, without the colour codes ComfyUI 0.33 puts around each line's level."""
        import re
        try:
            return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(encoding="utf-8", errors="replace"))
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc):
        self.stop()
