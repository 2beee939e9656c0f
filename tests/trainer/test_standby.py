"""The standby trainer (runner/standby.py, trainer/tasks/standby.py): a process started ahead of need takes a
single-process run and behaves exactly as a freshly started trainer; it never outlives its launcher."""
from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import REPO, read_events
from waiting import wait_until

launcher = importlib.import_module("ingraph_trainer.runner.launcher")
standby = importlib.import_module("ingraph_trainer.runner.standby")
trainer_main = importlib.import_module("ingraph_trainer.trainer.main")

WARM_UP_S = 180  # the imports take ~10 s alone; tests share 2 cores with a server and its trainers


@pytest.fixture
def fresh_standby(monkeypatch):
    monkeypatch.setenv(standby.ENABLE_ENV, "1")
    standby.discard()
    yield
    standby.discard()


def _finish(process, timeout=300) -> int:
    try:
        return process.proc.wait(timeout=timeout)
    finally:
        process.terminate()


def _events(run_dir):
    return [{k: v for k, v in e.items() if k not in ("time", "run_dir", "samples_per_s", "step_time_s", "eta_s",
                                                      "elapsed_s", "adapter", "seconds")}
            for e in read_events(run_dir)]


def _unread(channel) -> int:
    """Bytes sent on a Unix socket that its other end has not read yet (Linux's SIOCOUTQ)."""
    import fcntl
    import struct
    import termios
    return struct.unpack("i", fcntl.ioctl(channel.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def test_a_standby_run_gives_the_events_log_and_exit_code_of_a_cold_run(prepared, fresh_standby, monkeypatch):
    """A standby, told the run's model ahead of it (as the prompt hook tells it the queued Train node's), loads
    it before the run comes, and the run takes it: the run gives a cold run's events, losses and exit code."""
    import dataclasses

    from ingraph_trainer.trainer.spec import load_run_spec
    # one evaluation quantile (8 forward passes, not 40, before and after): the events still hold evaluations
    cold_spec = prepared(train__steps=2, train__precision="fp32", train__eval_quantiles=[0.5])
    warm_spec = prepared(train__steps=2, train__precision="fp32", train__eval_quantiles=[0.5])
    spec = load_run_spec(warm_spec)
    assert spec.model.stamps  # what the run checks the preloaded model against
    env = standby.trainer_environment(None)
    standby.prime(sys.executable, env, preload={"model": dataclasses.asdict(spec.model), "precision": "fp32"})
    assert standby._waiting.wait_ready(WARM_UP_S), "the standby never finished its imports"
    # the run is sent once the standby has read the preload (as in a graph, where nodes run between the two): sent
    # together, the standby would leave the load to the run
    assert wait_until(lambda: not _unread(standby._waiting.channel), 60)
    warm = launcher.TrainerProcess(warm_spec.parent, warm_spec, watch_parent=False).start()
    assert warm.standby
    assert _finish(warm) == 0
    monkeypatch.setenv(standby.ENABLE_ENV, "0")
    cold = launcher.TrainerProcess(cold_spec.parent, cold_spec, watch_parent=False).start()
    assert not cold.standby
    assert _finish(cold) == 0
    warm_events, cold_events = _events(warm_spec.parent), _events(cold_spec.parent)
    assert [e["type"] for e in warm_events] == [e["type"] for e in cold_events]
    assert [e.get("loss") for e in warm_events] == [e.get("loss") for e in cold_events]  # same seed, same numbers
    assert warm_events[0]["type"] == "started" and warm_events[-1]["type"] == "finished"
    warm_log = (warm_spec.parent / "trainer.log").read_text()
    # what the imports printed before the run existed (ComfyUI's memory line, on any device) is in the run's log
    assert "Total VRAM" in warm_log and "takes this run" in warm_log
    assert "ahead of its run in" in warm_log and "loaded ahead of the run" in warm_log, warm_log[-3000:]
    assert int((warm_spec.parent / "trainer.pid").read_text()) == warm.pid


def test_a_bad_spec_given_to_a_standby_exits_2_with_its_error_event(prepared, fresh_standby, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.toml").write_text("version = 1\n")  # unsigned: refused, as a cold trainer refuses it
    env = standby.trainer_environment(None)
    standby.prime(sys.executable, env)
    process = launcher.TrainerProcess(run_dir, run_dir / "run.toml", watch_parent=False).start()
    assert process.standby
    assert _finish(process) == trainer_main.EXIT_BAD_SPEC
    events = read_events(run_dir)
    assert events[-1]["type"] == "error" and "not the run this installation signed" in events[-1]["message"]


def test_terminate_during_a_standby_run_ends_its_whole_group(prepared, fresh_standby):
    spec = prepared(train__steps=5000, train__precision="fp32")
    standby.prime(sys.executable, standby.trainer_environment(None))
    process = launcher.TrainerProcess(spec.parent, spec, watch_parent=False).start()
    assert process.standby and os.getsid(process.pid) == process.pid  # its own session and group
    try:
        deadline = time.monotonic() + WARM_UP_S
        while not any(e["type"] == "started" for e in read_events(spec.parent)) and time.monotonic() < deadline:
            assert process.poll() is None, process.log_tail()
            time.sleep(0.1)
        assert process.poll() is None
    finally:
        rc = process.terminate()
    assert rc in (-signal.SIGTERM, -signal.SIGKILL, 1)  # stopped, as a cold trainer is
    with pytest.raises(ProcessLookupError):  # nothing of its group is left
        os.killpg(process.pid, 0)


def test_an_unassigned_standby_exits_when_its_launcher_dies(tmp_path):
    """The launcher (a ComfyUI server) is SIGKILLed: its standby must not stay behind."""
    pid_file = tmp_path / "standby.pid"
    script = textwrap.dedent(f"""
        import sys, time, types
        sys.path.insert(0, {str(REPO)!r})
        pkg = types.ModuleType("ingraph_trainer"); pkg.__path__ = [{str(REPO)!r}]
        sys.modules["ingraph_trainer"] = pkg
        from ingraph_trainer.runner import standby
        standby.prime(sys.executable, standby.trainer_environment(None))
        open({str(pid_file)!r}, "w").write(str(standby._waiting.proc.pid))
        print("ready" if standby._waiting.wait_ready({WARM_UP_S}) else "not ready", flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, **{standby.ENABLE_ENV: "1"}))
    try:
        assert parent.stdout.readline().strip() == "ready"
        pid = int(pid_file.read_text())
        os.kill(pid, 0)  # warm and waiting
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        parent.kill()


def test_a_standby_whose_launcher_is_gone_exits_before_its_imports(tmp_path):
    """Issue 32: a standby started as its launcher ends (a main job that exited) spent seconds of CPU on imports
    before it noticed. Python's import log says what it imported: not torch."""
    import socket
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a launcher that has exited: its pid names no process (or another one, started later)
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "trainer"), "--standby",
                               "--parent-pid", str(gone.pid)], stdin=theirs, capture_output=True, text=True,
                              timeout=120)
    finally:
        ours.close()
        theirs.close()
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "argparse" in imported or "json" in imported  # the log is there
    assert proc.returncode == 3 and "torch" not in imported, (proc.returncode, proc.stderr[-2000:])


def test_a_standby_whose_launcher_ends_mid_import_exits_without_finishing_it(tmp_path):
    """Issue 32: a standby checked for its launcher only between import steps, so one whose launcher ended while it
    imported torch (a main job that exited, a stopped server) lived on for the rest of that import. Its launcher is
    killed once the import log shows torch's own modules loading; the standby ends before torch's import does."""
    from ingraph_trainer.trainer.os_support import process_gone
    log = tmp_path / "imports.log"
    launcher_code = textwrap.dedent(f"""
        import os, socket, subprocess, sys
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-X", "importtime", {str(REPO / "trainer")!r}, "--standby",
                                 "--parent-pid", str(os.getpid())], stdin=theirs, stdout=subprocess.DEVNULL,
                                stderr=open({str(log)!r}, "w"))
        print(proc.pid, flush=True)
        sys.stdin.readline()
    """)
    launcher_proc = subprocess.Popen([sys.executable, "-c", launcher_code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
    standby_pid = int(launcher_proc.stdout.readline())
    imported = lambda: [line.rsplit("|", 1)[-1].strip() for line in log.read_text().splitlines()  # noqa: E731
                        if line.startswith("import time:")]
    deadline = time.monotonic() + WARM_UP_S
    while not any(name.startswith("torch.") for name in imported()):
        assert time.monotonic() < deadline and not process_gone(standby_pid), log.read_text()[-2000:]
        time.sleep(0.02)
    assert "torch" not in imported()  # in the middle of torch's import
    launcher_proc.kill()
    launcher_proc.wait()
    gone_at = time.monotonic()
    while not process_gone(standby_pid):
        assert time.monotonic() - gone_at < 30, "the standby outlived its launcher"
        time.sleep(0.02)
    assert "torch" not in imported(), f"it finished importing torch {time.monotonic() - gone_at:.1f} s after its launcher"


def test_multi_process_runs_start_through_deepspeed_not_the_standby(tmp_path, monkeypatch, fresh_standby):
    started = []

    class Waiting:  # a standby that must be left alone
        def hand_off(self, *_):
            raise AssertionError("a 2-process run was handed to the standby")

    monkeypatch.setattr(standby, "_waiting", Waiting())
    monkeypatch.setattr(standby, "prime", lambda *a: started.append("prime"))
    monkeypatch.setattr(launcher, "check_local_processes", lambda processes: [])  # (it asks NVML through Popen)
    monkeypatch.setattr(launcher.subprocess, "Popen",
                        lambda cmd, **kw: started.append(cmd) or type("P", (), {"pid": 1})())
    process = launcher.TrainerProcess(tmp_path, tmp_path / "run.toml", processes=2, watch_parent=False).start()
    assert not process.standby and isinstance(standby._waiting, Waiting)
    assert started and "deepspeed.launcher.runner" in started[0]  # and no standby primed for it
    assert started == [started[0]]
    monkeypatch.setattr(standby, "_waiting", None)


def test_standbys_start_only_for_training_prompts_and_never_when_switched_off(monkeypatch):
    primed = []
    monkeypatch.setattr(standby, "prime", lambda python, env, preload=None: primed.append(env["COMFYUI_PATH"]))
    paths = importlib.import_module("ingraph_trainer.runner.paths")
    monkeypatch.setattr(paths, "comfyui_root", lambda: "/comfy")

    class Queue:  # ComfyUI's prompt queue: (number, prompt_id, prompt, ...) items, running and waiting
        items = []

        def get_current_queue_volatile(self):
            return [], list(self.items)

    def wait_for_the_hook():
        for thread in [t for t in threading.enumerate() if t.name == "ingraph-standby-wait"]:
            thread.join(timeout=10)
    queue = Queue()
    assert standby.prime_for_prompt({"prompt": {"1": {"class_type": "CheckpointLoaderSimple"}}}, queue) == \
        {"prompt": {"1": {"class_type": "CheckpointLoaderSimple"}}}
    training = {"1": {"class_type": "CheckpointLoaderSimple"}, "2": {"class_type": "InGraphTrainLoRA"}}
    # validation refused it (it never reaches the queue): any client can send such a prompt, and it starts nothing
    rejected = standby.prime_for_prompt({"prompt": training}, queue, wait_s=0.3)
    assert isinstance(rejected["prompt_id"], str) and len(rejected["prompt_id"]) == 36
    wait_for_the_hook()
    assert primed == []
    # a flood of such prompts: one watcher thread follows the newest MAX_PENDING of them, and leaves with them
    for _ in range(200):
        standby.prime_for_prompt({"prompt": training}, queue, wait_s=0.3)
    assert len([t for t in threading.enumerate() if t.name == "ingraph-standby-wait"]) == 1
    assert len(standby._pending) == standby.MAX_PENDING
    wait_for_the_hook()
    assert primed == [] and not standby._pending and standby._watcher is None
    # validated and queued (a client's own id kept): primed
    own_id = "0b7e4c5e-36b1-4a43-9a61-2f5a3b9f0c11"
    queue.items = [(1, own_id, training, {}, [])]
    assert standby.prime_for_prompt({"prompt": training, "prompt_id": own_id}, queue)["prompt_id"] == own_id
    wait_for_the_hook()
    assert primed == ["/comfy"]
    # its node took the ready standby before the watcher saw the prompt queued (an idle server runs it at once):
    # nothing more is primed beside that run, which primes the next itself at its last step
    primed.clear()
    queue.items = []
    late_id = "5f0c2a9e-8d41-4c1e-b7a3-0e6d2c9b4a10"
    standby.prime_for_prompt({"prompt": training, "prompt_id": late_id}, queue)

    class Ready:
        python, env = "python", {"COMFYUI_PATH": "/comfy"}

        def alive(self):
            return True
    monkeypatch.setattr(standby, "_waiting", Ready())
    assert isinstance(standby.take("python", {"COMFYUI_PATH": "/comfy"}), Ready)
    queue.items = [(2, late_id, training, {}, [])]
    wait_for_the_hook()
    assert primed == [] and not standby._pending
    monkeypatch.undo()
    monkeypatch.setenv(standby.ENABLE_ENV, "0")
    standby.prime(sys.executable, standby.trainer_environment(None))
    assert standby._waiting is None and standby.take(sys.executable, standby.trainer_environment(None)) is None


def test_bitsandbytes_is_imported_only_by_runs_with_8bit_adamw():
    """peft imports bitsandbytes (2 s) when installed; only the 8-bit optimizer needs it."""
    script = textwrap.dedent(f"""
        import sys, types
        pkg = types.ModuleType("ingraph_trainer"); pkg.__path__ = [{str(REPO)!r}]
        sys.modules["ingraph_trainer"] = pkg
        from ingraph_trainer.trainer import main
        from ingraph_trainer.trainer.spec import RunSpec
        main.hide_optional_modules()
        import peft
        assert sys.modules.get("bitsandbytes") is None, "peft imported bitsandbytes"
        spec = RunSpec()
        main.reveal_modules_for(spec)
        assert sys.modules.get("bitsandbytes") is None, "revealed for a run with plain AdamW"
        spec.train.optimizer = "adamw8bit"
        main.reveal_modules_for(spec)
        import bitsandbytes
        print("ok", bitsandbytes.optim.AdamW8bit.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]


def test_the_next_standby_starts_when_training_is_over_not_beside_it(tmp_path, monkeypatch, fresh_standby):
    """A standby's ComfyUI import opens a CUDA context: started beside a run it would take that run's GPU memory."""
    primed = []
    monkeypatch.setattr(standby, "take", lambda *a: None)
    monkeypatch.setattr(standby, "prime", lambda *a: primed.append("prime"))

    class Running:
        pid, rc = 1, None

        def poll(self):
            return self.rc
    proc = Running()
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, **kw: proc)
    from ingraph_trainer.trainer.run.events import EventWriter
    from ingraph_trainer.trainer.run.layout import STOP_FILE
    process = launcher.TrainerProcess(tmp_path, tmp_path / "run.toml", watch_parent=False).start()
    events = EventWriter(tmp_path / "events.jsonl")
    events.emit("step", step=1, total=2)
    assert process.poll_events() and process.poll() is None and primed == []  # training: no standby beside it
    proc.rc = 0
    assert process.poll() == 0 and primed == ["prime"]
    assert process.poll() == 0 and primed == ["prime"]  # once
    # the final evaluation and the export come after the last step: the next run's standby warms meanwhile
    for finish in ("last step", "stop"):
        primed.clear()
        proc.rc = None
        process = launcher.TrainerProcess(tmp_path, tmp_path / "run.toml", watch_parent=False).start()
        if finish == "stop":
            (tmp_path / STOP_FILE).touch()
        else:
            events.emit("step", step=2, total=2)
        assert [e["step"] for e in process.poll_events()] == ([] if finish == "stop" else [2])
        assert process.poll() is None and primed == ["prime"], finish
        proc.rc = 0
        assert process.poll() == 0 and primed == ["prime"], finish
        (tmp_path / STOP_FILE).unlink(missing_ok=True)
    # an evaluation (the Evaluate node's run) is short, and a Train node often follows it: its standby starts now
    primed.clear()
    proc.rc = None
    evaluation = launcher.TrainerProcess(tmp_path, tmp_path / "run.toml", watch_parent=False, prime_beside=True).start()
    assert primed == ["prime"]
    proc.rc = 0
    assert evaluation.poll() == 0 and primed == ["prime"]


def test_the_queued_train_nodes_model_is_read_from_the_prompt_and_preloaded_only_on_an_idle_server(tmp_path,
                                                                                                   monkeypatch):
    """The prompt hook reads the queued Train node's model as the node will hand it off (the loader's file, LoRAs
    on the way, stamped) with its precision, and sends it to the standby only while no other prompt runs (whose
    run could take that standby); a Train node whose model no file describes, or two Train nodes, preload nothing."""
    from ingraph_trainer.runner.model_source import file_stamp
    ckpt, lora = tmp_path / "base.safetensors", tmp_path / "style.safetensors"
    ckpt.write_bytes(b"weights")
    lora.write_bytes(b"lora")
    files = {("checkpoints", "base.safetensors"): str(ckpt), ("loras", "style.safetensors"): str(lora)}
    resolve = lambda folder, name: files.get((folder, name))  # noqa: E731
    train = {"class_type": "InGraphTrainLoRA", "inputs": {"model": ["2", 0], "precision": "bf16",
                                                           "base_precision": "fp8"}}
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "base.safetensors"}},
              "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name":
                                                                    "style.safetensors", "strength_model": 0.5}},
              "3": train}
    queued = standby.queued_model(prompt, resolve)
    assert queued["precision"] == "bf16"
    model = queued["model"]
    assert (model["path"], model["format"], model["base_precision"]) == (str(ckpt), "checkpoint", "fp8")
    assert model["lora_paths"] == [str(lora)] and model["lora_strengths"] == [0.5]
    assert model["stamps"] == [file_stamp(ckpt), file_stamp(lora)]
    assert standby.queued_model({**prompt, "4": train}, resolve) is None  # which of two would come first: unknown
    patched = {**prompt, "2": {"class_type": "SomeModelPatch", "inputs": {"model": ["1", 0]}}}
    assert standby.queued_model(patched, resolve) is None  # materialised at the node: no file to load ahead
    assert standby.queued_model({**prompt, "3": {**train, "inputs": {"model": ["1", 0]}}}, resolve) is None

    sent = []
    monkeypatch.setattr(standby, "prime", lambda python, env, preload=None: sent.append(preload))
    monkeypatch.setattr(standby, "queued_model", lambda prompt: queued)
    monkeypatch.setattr(importlib.import_module("ingraph_trainer.runner.paths"), "comfyui_root", lambda: "/comfy")
    monkeypatch.setattr(standby, "_last_taken", 0.0)

    class Queue:
        running, queued = [], []

        def get_current_queue_volatile(self):
            return list(self.running), list(self.queued)
    queue = Queue()
    for others_running in (False, True):
        prompt_id = f"0b7e4c5e-36b1-4a43-9a61-2f5a3b9f0c1{int(others_running)}"
        queue.running = [(0, "another-prompt", {}, {}, [])] if others_running else []
        queue.queued = [(1, prompt_id, prompt, {}, [])]
        standby.prime_for_prompt({"prompt": prompt, "prompt_id": prompt_id}, queue)
        wait_until(lambda: not standby._pending, 10, every=0.01)  # until the watcher has seen it queued
        queue.running, queue.queued = [], []  # done: the watcher's idle preload finds no standby here, and leaves
        for thread in [t for t in threading.enumerate() if t.name == "ingraph-standby-wait"]:
            thread.join(timeout=10)
        assert standby._watcher is None
    assert sent == [queued, None]


def test_a_standby_loads_a_preload_unless_its_run_is_there_and_lets_it_go_after_a_while():
    """The standby's side of the socket: JSON lines; a preload is done at once when it comes alone, skipped when
    the run came with it (the run loads its model), and let go when its run does not come in time; the run's
    command line comes with the log's descriptor."""
    import json
    import socket

    trainer_standby = importlib.import_module("ingraph_trainer.trainer.tasks.standby")
    run = ["--config", "/r/run.toml"]
    line = lambda message: json.dumps(message).encode() + b"\n"  # noqa: E731

    def serve(*sends, keep_s=600.0, pause=0.0):
        """sends: (bytes, with the log's descriptor) each one sendmsg, `pause` seconds apart."""
        ours, theirs = socket.socketpair()
        preloads, expired = [], []
        with open(os.devnull) as log:
            def send():
                for data, with_log in sends:
                    socket.send_fds(ours, [data], [log.fileno()] if with_log else [])
                    time.sleep(pause)
            sender = threading.Thread(target=send)
            sender.start()
            got = trainer_standby.wait_for_command(theirs, 30, on_preload=preloads.append,
                                                   on_preload_expired=lambda: expired.append(1),
                                                   preload_keep_s=keep_s)
            sender.join()
        ours.close()
        theirs.close()
        if got is not None:
            os.close(got[1])
        return got and got[0], preloads, expired

    assert serve((line({"preload": {"m": 1}}), False), (line(run), True), pause=0.3) == (run, [{"m": 1}], [])
    assert serve((line({"preload": {"m": 1}}) + line(run), True)) == (run, [], [])  # the run came with it
    assert serve((line({"preload": {"m": 2}}), False), (line(run), True), keep_s=0.1, pause=0.6) == \
        (run, [{"m": 2}], [1])


def test_a_run_takes_the_preloaded_model_only_when_its_spec_loads_the_same_and_its_files_are_unchanged(
        tmp_path, monkeypatch):
    """The model loaded ahead of a run is that run's only if the run's model section and precision give the same
    load (files, stamps, dtype, precision, LoRAs); otherwise it is dropped and the run loads its own. A file
    rewritten since the preload (the run's own stamps then differ from it) is refused, as any stale file is."""
    import dataclasses

    from ingraph_trainer.runner.model_source import file_stamp
    import contextlib

    from ingraph_trainer.trainer import comfy_compat, models
    from ingraph_trainer.trainer.spec import ModelSpec
    monkeypatch.setattr(comfy_compat, "loads_to_host", contextlib.nullcontext)  # (its own test: test_comfy_compat)
    path = tmp_path / "base.safetensors"
    path.write_bytes(b"weights")
    loads = []
    monkeypatch.setattr(models, "load_base_model", lambda model, precision, deferred=None:
                        loads.append((model.path, precision)) or object())
    model = ModelSpec(path=str(path), format="checkpoint", stamps=[file_stamp(path)])
    models.preload_base_model(model, "bf16")
    preloaded = models._preloaded[0][1]
    assert models._take_preloaded(model, "bf16") is preloaded and not models._preloaded
    for other, precision in ((model, "fp32"), (dataclasses.replace(model, weight_dtype="fp8_e4m3fn"), "bf16"),
                             (dataclasses.replace(model, lora_paths=["/l"], lora_strengths=[1.0]), "bf16")):
        models.preload_base_model(model, "bf16")
        assert models._take_preloaded(other, precision) is None and not models._preloaded
    models.preload_base_model(dataclasses.replace(model, stamps=[]), "bf16")  # nothing to check it against
    assert not models._preloaded
    models.preload_base_model(model, "bf16")
    path.write_bytes(b"other weights")
    rewritten = dataclasses.replace(model, stamps=[file_stamp(path)])
    assert models._take_preloaded(rewritten, "bf16") is None  # another stamp: another load
    models.preload_base_model(model, "bf16")  # (the preload's own stamp check is load_base_model's)
    with pytest.raises(ValueError, match="model.stamps: .* changed since the graph loaded it"):
        models._take_preloaded(model, "bf16")
    assert len(loads) == 6 and not models._preloaded


def test_once_the_queue_is_idle_the_last_training_prompts_model_waits_in_the_standby_where_memory_allows(
        tmp_path, monkeypatch):
    """Queued again, a graph runs only its changed nodes and its Train node starts at once, before any model could
    load: so once ComfyUI's queue is idle, the standby gets the last training prompt's model to hold, where the
    machine has the memory for an idle copy (half its available memory at most), and not twice."""
    import json
    import struct

    import torch
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(256, 256, dtype=torch.float16)}, str(tmp_path / "base.safetensors"))
    payload = {"model": {"path": str(tmp_path / "base.safetensors"), "lora_paths": []}, "precision": "fp32"}
    assert standby.room_for_idle_model(payload)
    # a file whose header says 4 TiB of fp16 weights (sparse: no disk space): the trainer would hold 8 TiB
    header = json.dumps({"w": {"dtype": "F16", "shape": [1 << 41], "data_offsets": [0, 1 << 42]}}).encode()
    with open(tmp_path / "huge.safetensors", "wb") as huge:
        huge.write(struct.pack("<Q", len(header)) + header)
        huge.truncate(8 + len(header) + (1 << 42))
    assert not standby.room_for_idle_model({**payload, "model": {"path": huge.name, "lora_paths": []}})
    assert not standby.room_for_idle_model({**payload, "model": {"path": str(tmp_path / "gone"), "lora_paths": []}})

    class Waiting:  # the standby primed at the run's last step
        preloaded = None

        def alive(self):
            return True

        def holds(self, payload=None):
            return self.preloaded is not None

        def preload(self, sent):
            self.preloaded = sent
            received.append(sent)
    monkeypatch.setattr(standby, "prime", lambda python, env, preload=None: None)
    monkeypatch.setattr(standby, "queued_model", lambda prompt: payload)
    monkeypatch.setattr(importlib.import_module("ingraph_trainer.runner.paths"), "comfyui_root", lambda: "/comfy")
    monkeypatch.setattr(standby, "_last_taken", 0.0)

    class Queue:
        running = []

        def get_current_queue_volatile(self):
            return list(self.running), []
    for room in (True, False):
        received = []
        monkeypatch.setattr(standby, "_waiting", Waiting())
        monkeypatch.setattr(standby, "room_for_idle_model", lambda sent: room)
        queue = Queue()
        prompt_id = f"0b7e4c5e-36b1-4a43-9a61-2f5a3b9f0c2{int(room)}"
        queue.running = [(0, prompt_id, {"2": {"class_type": "InGraphTrainLoRA"}}, {}, [])]
        standby.prime_for_prompt({"prompt": {"2": {"class_type": "InGraphTrainLoRA"}}, "prompt_id": prompt_id}, queue)
        wait_until(lambda: not standby._pending, 10, every=0.01)  # until the watcher has seen it running
        time.sleep(0.3)  # (polls of a queue still running)
        assert received == []  # the prompt still runs
        queue.running = []
        for thread in [t for t in threading.enumerate() if t.name == "ingraph-standby-wait"]:
            thread.join(timeout=10)
        assert received == ([payload] if room else []) and standby._after_queue is None
        standby.preload_when_idle(payload)  # sent already, or no room: nothing more
        assert received == ([payload] if room else [])
    monkeypatch.setattr(standby, "_waiting", None)


def test_the_memory_check_before_a_load_counts_the_runs_preloaded_model_as_loaded_and_lets_another_go_first(
        tmp_path, monkeypatch):
    """The host-memory check a run makes before its load (memory_plan.refuse_unloadable) sees a preload of the
    run's own model as loaded already (nothing more to hold: no refusal for memory the preload itself takes), and
    drops a preload of another model before it measures."""
    import contextlib
    import dataclasses

    import torch
    from safetensors.torch import save_file

    from ingraph_trainer.runner.model_source import file_stamp
    from ingraph_trainer.trainer import comfy_compat, models, os_support
    from ingraph_trainer.trainer.parallel import memory_plan
    from ingraph_trainer.trainer.spec import ModelSpec
    monkeypatch.setattr(comfy_compat, "loads_to_host", contextlib.nullcontext)
    monkeypatch.setattr(models, "load_base_model", lambda model, precision, deferred=None: object())
    monkeypatch.setattr(os_support, "available_memory", lambda: 1024)  # nothing of the model fits
    path = tmp_path / "base.safetensors"
    save_file({"w": torch.zeros(256, 256, dtype=torch.float16)}, str(path))
    model = ModelSpec(path=str(path), stamps=[file_stamp(path)])
    with pytest.raises(memory_plan.MemoryPlanRefused):
        memory_plan.refuse_unloadable(model, "bf16")
    models.preload_base_model(model, "bf16")
    memory_plan.refuse_unloadable(model, "bf16")  # its weights are in memory already
    assert models._preloaded
    with pytest.raises(memory_plan.MemoryPlanRefused):
        memory_plan.refuse_unloadable(dataclasses.replace(model, weight_dtype="fp8_e4m3fn"), "bf16")
    assert not models._preloaded  # let go before the check measured
