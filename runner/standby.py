"""One trainer process kept started ahead of need, so a run does not wait for torch, ComfyUI, DeepSpeed and
peft to import (about 10 s on 2 CPU cores; trainer/tasks/standby.py is its other half).

When: the first standby starts when a prompt with a node that launches a trainer (Train LoRA, Distill, Evaluate) is
queued, so its imports overlap the graph's own work before that node (loading the model, caching); after each
single-process run is handed to it, a fresh one starts for the next run. A ComfyUI that never trains never
starts one, and an unused standby exits after INGRAPH_STANDBY_IDLE_S seconds (default 900), giving its memory
back (measured idle: 0.8 GB RSS, 0.5 GB PSS on CPU; on a GPU machine it also holds a CUDA context). Starting it
when ComfyUI starts instead would charge that to every user who never trains; INGRAPH_STANDBY=eager does it
anyway (for a server that trains all day), and INGRAPH_STANDBY=0 turns it off: every run then starts its own
process, as multi-process (DeepSpeed launcher) runs always do.

The queued prompt's Train node's model goes to the standby too (queued_model: read from the prompt as the node will
hand it off), which loads it while the graph's earlier nodes run (loading the model in ComfyUI, caching), so the
Train node's run starts with its model in memory. Only while no other prompt runs; the run takes it only where
its own spec gives the same load, else it is dropped first. It holds a second copy of the weights beside
ComfyUI's a little earlier than the run would.

A standby is used only by a run whose environment is exactly the one it was started with (the server's
environment plus the launcher's variables, COMFYUI_PATH included) and with the same Python; otherwise it is
stopped and the run starts cold.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..trainer.os_support import own_process_group, signal_tree, standby_supported

log = logging.getLogger("ingraph_trainer")

PACK_ROOT = Path(__file__).resolve().parent.parent
ENABLE_ENV = "INGRAPH_STANDBY"
IDLE_ENV = "INGRAPH_STANDBY_IDLE_S"
DEFAULT_IDLE_S = 900.0
# prompts holding one of these nodes start a standby when queued
TRAINER_NODES = frozenset({"InGraphTrainLoRA", "InGraphDistill", "InGraphEvaluate"})


def enabled() -> bool:
    """Standbys are on unless turned off, where the system can hand a run over (os_support.standby_supported)."""
    return standby_supported() and os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def idle_seconds() -> float:
    try:
        return float(os.environ.get(IDLE_ENV) or DEFAULT_IDLE_S)
    except ValueError:
        return DEFAULT_IDLE_S


class Standby:
    """A started, unassigned trainer process and the launcher's end of its command socket."""

    def __init__(self, python: str, env: dict[str, str]):
        self.python = python
        self.env = env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # its output until it is given a run: an unnamed file it copies into the run's log at the hand-off
        output = tempfile.TemporaryFile(prefix="ingraph-standby-")
        try:
            cmd = [python, str(PACK_ROOT / "trainer"), "--standby", "--parent-pid", str(os.getpid()),
                   "--idle-s", str(idle_seconds())]
            # own session, as every trainer: a signal to the group reaches this process and its children only
            self.proc = subprocess.Popen(cmd, stdin=theirs.fileno(), stdout=output, stderr=subprocess.STDOUT,
                                         cwd=PACK_ROOT, env=env, **own_process_group())
        finally:
            theirs.close()
            output.close()
        self.channel = ours
        self.preloaded: tuple[dict, float] | None = None  # (the model sent to it to load ahead of its run, when)

    def wait_ready(self, timeout: float) -> bool:
        """True once its imports are done (it says so on the socket); False on timeout or if it died."""
        import select
        ready, _, _ = select.select([self.channel], [], [], timeout)
        return bool(ready) and self.channel.recv(16) == b"ready\n"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def hand_off(self, argv: list[str], log_fd: int) -> bool:
        """Gives the standby its run; False when it is gone (the run then starts cold)."""
        if not self.alive():
            self.close()
            return False
        try:
            socket.send_fds(self.channel, [json.dumps(argv).encode() + b"\n"], [log_fd])
        except OSError:
            self.stop()
            return False
        self.channel.close()  # one run per standby; nothing is sent after it
        return True

    def preload(self, payload: dict) -> None:
        """Asks the standby to load the queued run's model now (trainer/tasks/standby.py preload); a standby gone or
        busy is no matter: the run loads its model itself."""
        try:
            self.channel.sendall(json.dumps({"preload": payload}).encode() + b"\n")
            self.preloaded = (payload, time.monotonic())
        except OSError:
            pass

    def holds(self, payload: dict | None = None) -> bool:
        """Whether it holds a preloaded model (`payload`'s, where given): sent, and not yet let go."""
        from ..trainer.tasks.standby import PRELOAD_KEEP_S
        if self.preloaded is None or time.monotonic() - self.preloaded[1] >= PRELOAD_KEEP_S:
            return False
        return payload is None or self.preloaded[0] == payload

    def close(self):
        self.channel.close()

    def stop(self):
        """Kills an unassigned standby: it holds nothing of a run, so there is nothing to let it finish."""
        self.close()
        if self.proc.poll() is None:
            signal_tree(self.proc.pid, force=True)
        self.proc.wait()


_lock = threading.Lock()
_waiting: Standby | None = None


def trainer_environment(comfyui_path: str | None) -> dict[str, str]:
    """The environment every trainer of this server gets (standby or not)."""
    # PYTHONSAFEPATH: `python -m deepspeed...` would put the working folder first on sys.path (in every
    # process it starts); and the working folder is the pack's, never the run's: DeepSpeed reads
    # ./.deepspeed_env, and the run folder is under output/, which any client can write
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1")
    if comfyui_path:
        env["COMFYUI_PATH"] = str(comfyui_path)
    return env


def prime(python: str, env: dict[str, str], preload: dict | None = None):
    """Makes sure a standby for (python, env) is started, unless standbys are off; `preload` (queued_model's) is
    sent to it, to load while the graph's earlier nodes run."""
    global _waiting
    if not enabled():
        return
    with _lock:
        if _waiting is None or not _waiting.alive() or (_waiting.python, _waiting.env) != (python, env):
            stale, _waiting = _waiting, None
            if stale is not None:
                stale.stop()
            try:
                _waiting = Standby(python, env)
            except OSError as exc:
                log.warning("InGraph Trainer: no standby trainer (%s); runs start their own process", exc)
                return
        if preload is not None and not _waiting.holds(preload):
            _waiting.preload(preload)


def queued_model(prompt: dict, resolve=None) -> dict | None:
    """The model section and precision the prompt's one Train LoRA node will hand its trainer, read from the prompt
    as the node reads them (model_source.describe_model: the loader's files, LoRAs on the way), so a standby can
    load the model while the graph's earlier nodes run; None where the prompt has another number of Train nodes,
    its model is not described by files, or its precision is not given in it. The run takes the preloaded model
    only if its own spec gives the same load (trainer/models load_key), so a wrong guess costs time, never a
    result. `resolve(folder, name)`: a loader's file (ComfyUI's folder_paths by default)."""
    import dataclasses

    from ..trainer.spec import BASE_PRECISION_CHOICES, PRECISION_CHOICES, choice_value
    from .model_source import describe_model, input_link
    trains = [node_id for node_id, node in prompt.items()
              if isinstance(node, dict) and node.get("class_type") == "InGraphTrainLoRA"]
    if len(trains) != 1:
        return None
    inputs = prompt[trains[0]].get("inputs") or {}
    if inputs.get("distributed") is not None:  # DeepSpeed's processes load their own copies; a standby takes none
        return None
    try:
        link = input_link(prompt, trains[0], "model")
        source = describe_model(prompt, link, resolve=resolve) if resolve else describe_model(prompt, link)
        precision = choice_value(PRECISION_CHOICES, inputs["precision"], "precision")
        model = source.model_spec("auto")
        if "base_precision" in inputs:
            model.base_precision = choice_value(BASE_PRECISION_CHOICES, inputs["base_precision"], "base_precision")
    except Exception as exc:  # noqa: BLE001 - it runs in ComfyUI's prompt hook, which must never fail a prompt
        log.debug("InGraph Trainer: no model to load ahead (%s: %s)", type(exc).__name__, exc)
        return None
    return {"model": dataclasses.asdict(model), "precision": precision}


def run_started() -> None:
    """A run starts now (from a standby, cold, or on several processes): the prompt hook primes none beside it."""
    global _last_taken
    _last_taken = time.monotonic()


def take(python: str, env: dict[str, str]) -> Standby | None:
    """The ready standby when it matches (python, env) and still runs; None otherwise (the run starts cold)."""
    global _waiting
    if not enabled():
        return None
    with _lock:
        standby, _waiting = _waiting, None
    run_started()
    if standby is None:
        return None
    if standby.alive() and (standby.python, standby.env) == (python, env):
        return standby
    standby.stop()
    return None


def discard():
    """Stops the ready standby, if any (tests; a server shutting down closes its socket anyway)."""
    global _waiting
    with _lock:
        standby, _waiting = _waiting, None
    if standby is not None:
        standby.stop()


QUEUED_WAIT_S = 60.0  # how long after a training prompt arrives its validation may take before it is queued
MAX_PENDING = 32  # training prompts waiting to be queued that the watcher follows (a flood keeps the newest)
# prompt id -> (when it came, when to stop waiting for it: monotonic, its queued_model)
_pending: dict[str, tuple[float, float, dict | None]] = {}
_last_taken = 0.0  # when a run last started (time.monotonic; run_started)
_pending_lock = threading.Lock()
_watcher: threading.Thread | None = None
# the last training prompt's queued_model, loaded into the standby once ComfyUI's queue is idle (users queue the
# same graph again: only its changed nodes run, and the Train node starts at once, before a model could load)
_after_queue: dict | None = None


def prime_for_prompt(json_data: dict, queue=None, wait_s: float = QUEUED_WAIT_S) -> dict:
    """ComfyUI's on-prompt hook: a training prompt gets a standby warming up once ComfyUI has validated and queued
    it. The hook runs before validation, and a rejected prompt (any client can send one) must start nothing: a
    standby is a trainer process (~0.8 GB, and a CUDA context on a GPU) that lives for minutes. So the prompt gets
    its id here (ComfyUI keeps a client's own), and one watcher thread, whatever the number of prompts, primes once
    any of the ids it follows is in ComfyUI's queue."""
    global _watcher
    prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
    if isinstance(prompt, dict) and any(isinstance(node, dict) and node.get("class_type") in TRAINER_NODES
                                        for node in prompt.values()):
        if queue is None:
            from server import PromptServer
            queue = PromptServer.instance.prompt_queue
        if not isinstance(json_data.get("prompt_id"), str):
            import uuid
            json_data["prompt_id"] = str(uuid.uuid4())  # canonical: ComfyUI 0.33 refuses any other form
        with _pending_lock:
            now = time.monotonic()
            _pending[json_data["prompt_id"]] = (now, now + wait_s, queued_model(prompt))
            while len(_pending) > MAX_PENDING:
                del _pending[next(iter(_pending))]  # the oldest
            if _watcher is None:
                _watcher = threading.Thread(target=_prime_once_queued, args=(queue,), name="ingraph-standby-wait",
                                            daemon=True)
                _watcher.start()
    return json_data


def _prime_once_queued(queue):
    """The watcher: polls ComfyUI's queue for the pending ids, primes when one is there; then, once the queue is
    idle, hands the standby the last training prompt's model (preload_when_idle); leaves when it has neither to
    do."""
    global _watcher, _after_queue
    while True:
        with _pending_lock:
            now = time.monotonic()
            for prompt_id in [p for p, (_, until, _) in _pending.items() if until < now]:
                del _pending[prompt_id]
            if not _pending and _after_queue is None:
                _watcher = None
                return
            waiting = set(_pending)
        try:
            running, queued = queue.get_current_queue_volatile()
        except Exception as exc:  # noqa: BLE001  (a ComfyUI without this method: no standby, runs start cold)
            log.debug("InGraph Trainer: no standby (%s)", exc)
            with _pending_lock:
                _pending.clear()
                _after_queue = None
                _watcher = None
            return
        if not waiting:  # only the idle preload is left to do
            if not running and not queued:
                with _pending_lock:
                    payload, _after_queue = _after_queue, None
                preload_when_idle(payload)
            time.sleep(0.2)
            continue
        found = {item[1] for item in (*running, *queued) if len(item) > 1} & waiting
        if found:
            with _pending_lock:
                came, _, preload = max((_pending.pop(prompt_id, (0.0, 0.0, None)) for prompt_id in found),
                                       key=lambda entry: entry[0])
                _after_queue = preload
            # a standby taken since the prompt came served it (its node ran before this poll saw it queued): one
            # primed now would warm beside that run, taking its CPU (the run's model load took 3x as long) and, on a
            # GPU, memory; that run primes the next standby itself at its last step. Its model is preloaded only
            # while no other prompt runs (whose trainer's memory it would crowd, and whose run may take it)
            if _last_taken < came:
                from . import paths
                others = any(len(item) > 1 and item[1] not in found for item in running)
                prime(sys.executable, trainer_environment(paths.comfyui_root()), None if others else preload)
        time.sleep(0.05)


def preload_when_idle(payload: dict | None) -> None:
    """Sends the waiting standby the model of the training prompt that just ended, where it was given none and the
    machine has the memory to hold it idle (room_for_idle_model); the standby lets it go after its keep time."""
    if payload is None:
        return
    with _lock:
        standby = _waiting
        if standby is not None and standby.alive() and not standby.holds() and room_for_idle_model(payload):
            standby.preload(payload)


def room_for_idle_model(payload: dict) -> bool:
    """Whether the model can wait in memory beside everything else: the bytes the trainer will hold of it (read
    from the file's header: trainer.parallel.memory_sizes.load_bytes) at most half of what the system has available now.
    False where either cannot be read: an idle copy of a model is a guess, and memory is what users run out of."""
    from ..trainer.parallel.memory_sizes import load_bytes
    from ..trainer.os_support import available_memory
    from ..trainer.spec import ModelSpec
    try:
        held = load_bytes(ModelSpec(**payload["model"]), payload["precision"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    available = available_memory()
    return held is not None and available is not None and held * 2 <= available


def register_prompt_hook():
    try:
        from server import PromptServer
    except ImportError:  # not inside a ComfyUI server
        return
    if getattr(PromptServer, "instance", None) is not None:
        PromptServer.instance.add_on_prompt_handler(prime_for_prompt)
    if os.environ.get(ENABLE_ENV, "").strip().lower() == "eager":
        from . import paths
        prime(sys.executable, trainer_environment(paths.comfyui_root()))
