"""The Windows branches of every operating-system call (trainer/os_support.py), taken on Linux: the platform module
sees `os.name == "nt"`, and what Windows lacks is removed from this process (os.killpg, signal.SIGKILL,
socket.AF_UNIX, socket.send_fds). The trainer the launcher starts is a real Linux process; what is checked is the
launcher's decisions and that they work: a one-process run trains and reports success, Cancel leaves no process."""
from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import time
import types

import psutil
import pytest

from conftest import read_events

launcher = importlib.import_module("ingraph_trainer.runner.launcher")
standby = importlib.import_module("ingraph_trainer.runner.standby")
os_support = importlib.import_module("ingraph_trainer.trainer.os_support")

CREATE_NEW_PROCESS_GROUP = 0x200


@pytest.fixture
def windows(monkeypatch):
    """The platform module's view of `os` says Windows; the calls Windows lacks are gone from this process; Popen
    records its arguments and takes Windows' creation flag as POSIX's own session (it refuses creationflags)."""
    view = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    view.name = "nt"
    monkeypatch.setattr(os_support, "os", view)
    for module, name in ((os, "killpg"), (signal, "SIGKILL"), (socket, "AF_UNIX"), (socket, "send_fds")):
        monkeypatch.delattr(module, name)
    monkeypatch.setenv(standby.ENABLE_ENV, "1")  # standbys asked for: the platform must say no
    monkeypatch.setattr(standby, "_waiting", None)
    started = []
    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):
        started.append(dict(kwargs))
        kwargs.pop("creationflags", None)
        return real_popen(cmd, **{"start_new_session": True, **kwargs})
    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    return started


def test_a_one_process_run_on_windows_trains_and_reports_success(prepared, windows):
    spec = prepared(train__steps=2, train__precision="fp32", train__eval_quantiles=[0.5])
    process = launcher.TrainerProcess(spec.parent, spec, watch_parent=False).start()
    try:
        assert process.proc.wait(timeout=300) == 0, process.log_tail()
        assert process.poll() == 0  # where a POSIX launcher primes the next standby: Windows has no hand-off
    finally:
        process.terminate()
    assert not process.standby and standby._waiting is None and len(windows) == 1
    assert windows[0].get("creationflags") == CREATE_NEW_PROCESS_GROUP and "start_new_session" not in windows[0]
    events = read_events(spec.parent)
    assert events[-1]["type"] == "finished" and events[-1]["steps"] == 2
    assert (spec.parent / "lora.safetensors").is_file()


def test_cancel_on_windows_leaves_no_process(prepared, windows):
    spec = prepared(train__steps=10_000, train__precision="fp32", train__eval_quantiles=[0.5])
    process = launcher.TrainerProcess(spec.parent, spec, watch_parent=False).start()
    try:
        deadline = time.monotonic() + 240
        while not any(e["type"] == "step" for e in read_events(spec.parent)):
            assert process.proc.poll() is None and time.monotonic() < deadline, process.log_tail()
            time.sleep(0.2)
        tree = [psutil.Process(process.pid)] + psutil.Process(process.pid).children(recursive=True)
    finally:
        process.terminate(grace_s=5.0)
    assert process.proc.returncode is not None
    alive = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive


def test_a_file_held_open_elsewhere_is_replaced_once_windows_lets_go(monkeypatch, tmp_path):
    """A sharing violation (PermissionError) is retried on Windows; on POSIX it is an error at once."""
    source, target = tmp_path / "new", tmp_path / "target"
    source.write_text("new")
    refusals = []

    def replace(a, b):
        if len(refusals) < 2:
            refusals.append(b)
            raise PermissionError(13, "The process cannot access the file: it is being used by another process")
        os.replace(a, b)
    view = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    view.replace, view.name = replace, "posix"
    monkeypatch.setattr(os_support, "os", view)
    with pytest.raises(PermissionError):
        os_support.replace_file(source, target)
    assert len(refusals) == 1 and not target.exists()
    view.name = "nt"
    os_support.replace_file(source, target)  # refused once more, then done
    assert target.read_text() == "new" and len(refusals) == 2


def test_paths_windows_cannot_open_are_refused_naming_them(monkeypatch, tmp_path):
    deep = tmp_path / ("x" * 120) / ("y" * 120) / "lora.safetensors"
    assert os_support.path_problem(deep) is None  # POSIX opens it
    view = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    view.name = "nt"
    monkeypatch.setattr(os_support, "os", view)
    problem = os_support.path_problem(deep)
    assert problem and str(deep) in problem and "259" in problem
    assert os_support.path_problem(tmp_path / "lora.safetensors") is None


def test_memory_probes_on_windows_come_from_psutil(monkeypatch):
    view = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    view.name = "nt"
    monkeypatch.setattr(os_support, "os", view)
    info = types.SimpleNamespace(rss=123, peak_wset=456)  # psutil's Windows fields
    monkeypatch.setattr(psutil.Process, "memory_info", lambda self: info)
    assert os_support.host_memory() == (123, 456)
    opened = []
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a) or (_ for _ in ()).throw(OSError()))
    os_support.restart_memory_peak()
    assert not opened  # no /proc on Windows


def test_through_a_comfyui_server_on_windows_a_run_succeeds_and_cancel_leaves_no_process(assets, tmp_path):
    """A ComfyUI server (and every trainer it starts) whose platform module sees Windows (tests/windows_view):
    a one-process run from the graph trains and the node succeeds; a second run, cancelled, leaves no process."""
    from client.api import ComfyClient
    from conftest import REPO, small_server, wait_first_step
    from conftest import training_only
    mark = tmp_path / "windows_processes"
    server = small_server(assets, tmp_path / "windows", pack_name="ingraph_trainer", extra_env={
        "PYTHONPATH": str(REPO / "tests" / "windows_view"), "INGRAPH_FAKE_WINDOWS": "1",
        "INGRAPH_FAKE_WINDOWS_MARK": str(mark), standby.ENABLE_ENV: "1"})
    client = ComfyClient(server.address)
    try:
        outcome = client.follow(client.queue(training_only("windows_run", 3)), timeout=300)
        assert outcome.ok, outcome.error
        assert (server.base_dir / "models" / "loras" / "windows_run.safetensors").is_file()
        runs = server.base_dir / "output" / "ingraph" / "runs"
        first = int(next(runs.glob("*windows_run*/trainer.pid")).read_text())
        marked = {int(line) for line in mark.read_text().split()}
        assert server.proc.pid in marked and first in marked  # both saw Windows
        server_process = psutil.Process(server.proc.pid)
        assert not [p for p in server_process.children(recursive=True) if "--standby" in p.cmdline()]

        prompt_id = client.queue(training_only("windows_cancel", 5000))
        run_id = wait_first_step(client, prompt_id)["run_id"]
        pid = int((runs / run_id / "trainer.pid").read_text())
        tree = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
        client.post("/interrupt")
        outcome = client.follow(prompt_id, timeout=120)
        assert not outcome.ok
        deadline = time.monotonic() + 15
        while [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
            assert time.monotonic() < deadline, [p.pid for p in tree if p.is_running()]
            time.sleep(0.1)
        assert pid in {int(line) for line in mark.read_text().split()}
    finally:
        client.close()
        server.stop()


def test_a_parent_whose_pid_was_given_to_another_process_counts_as_gone(monkeypatch):
    """Windows hands a dead process's pid out again quickly, and os.getppid() there keeps naming the dead parent:
    the watchdog tells its parent by start time too (psutil's create_time, faked here)."""
    view = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    view.name = "nt"
    monkeypatch.setattr(os_support, "os", view)
    me = os.getpid()
    started = os_support.process_started(me)
    assert started is not None and not os_support.process_gone(me, started)
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: started + 5.0)  # the pid, reused
    assert os_support.process_gone(me, started)
    assert not os_support.process_gone(me)  # without the start time a reused pid looks alive
