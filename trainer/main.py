"""The trainer program: `python <pack>/trainer --config run.toml` (or under `deepspeed`)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from .spec import RunSpecError, load_run_spec, parse_run_spec
from .run.events import EVENTS_FILE, EventWriter
from .optim import OPTIMIZERS_KNOWN
from .os_support import process_gone, process_started

EXIT_BAD_SPEC = 2
EXIT_FAILED = 1
EXIT_ORPHANED = 3

# Imported only by the runs that use them (an optimizer record's `optional`): peft imports bitsandbytes (2 s) when
# it is installed, for layers of bitsandbytes' own that this trainer never builds; 8-bit AdamW is its only use here.
OPTIONAL_MODULES = {o.library: tuple(p.value for p in OPTIMIZERS_KNOWN if p.library == o.library)
                    for o in OPTIMIZERS_KNOWN if o.optional}


def hide_optional_modules():
    """Until a run asks for them, the optional modules look absent (find_spec says None, import fails)."""
    for name in OPTIONAL_MODULES:
        sys.modules.setdefault(name, None)


def reveal_modules_for(spec):
    for name, optimizers in OPTIONAL_MODULES.items():
        if spec.train.optimizer in optimizers and name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


def configure_logging():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def start_parent_watchdog(parent_pid: int, events: EventWriter, interval: float = 1.0, parent_host: str = ""):
    """Exit when the process that launched us (ComfyUI) is gone: nobody would read our results.

    Only on the machine that launched the run: elsewhere that pid means nothing (the run's ranks there
    end when the launching machine's ranks do)."""
    import socket
    if parent_pid <= 0 or (parent_host and parent_host != socket.gethostname()):
        return

    direct_child = os.getppid() == parent_pid
    started = process_started(parent_pid)

    def watch():
        while True:
            time.sleep(interval)
            if (direct_child and os.getppid() != parent_pid) or process_gone(parent_pid, started):
                events.emit("error", last=True, message=f"parent process {parent_pid} exited; trainer stopping")
                os._exit(EXIT_ORPHANED)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def use_the_servers_secret():
    """By hand, where the operator named no secret: the one this ComfyUI's server signs its runs with (its data
    folder's, runner/paths.use_data_folder_secret), where there is one, so its runs resume; else the home folder's."""
    from .comfy_env import comfyui_path
    from .run.layout import DATA_DIR_ENV, DATA_FOLDER
    from .run.trust import SECRET_ENV
    if os.environ.get(SECRET_ENV):
        return
    try:
        folder = Path(os.environ[DATA_DIR_ENV]) if os.environ.get(DATA_DIR_ENV) else comfyui_path() / DATA_FOLDER
    except RuntimeError:  # no ComfyUI here: the run fails with that error later
        return
    if (folder / "secret").is_file():
        os.environ[SECRET_ENV] = str(folder / "secret")


def load_signed_spec(config: str):
    """The spec from one read of its bytes, whose signature rank 0 checks on exactly those bytes."""
    from .run.layout import SPEC_FILE
    from .run.trust import TrustError, verify_run
    path = Path(config)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RunSpecError(f"{path}: run spec cannot be read ({type(exc).__name__})") from None
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            verify_run(path.parent, SPEC_FILE, held={path.name: raw} if path.name == SPEC_FILE else None)
            if path.name != SPEC_FILE:
                raise TrustError(f"{path} is not the run folder's {SPEC_FILE}")
        except (TrustError, OSError) as exc:
            raise RunSpecError(f"{path}: not the run this installation signed ({exc})") from None
    return parse_run_spec(raw, str(path))


def report_spec_error(config: str, exc: Exception):
    """A spec that cannot be used still reaches the node as an error event: the spec sits in its run directory."""
    run_dir = Path(config).parent
    if int(os.environ.get("RANK", "0")) != 0 or not run_dir.is_dir():
        return
    events = EventWriter(run_dir / EVENTS_FILE)
    try:
        events.emit("error", message=f"RunSpecError: {exc}", rank=0)
    finally:
        events.close()


def finished_before(spec) -> dict | None:
    """The run folder's last `finished` event, if a run of this spec finished there."""
    from .run.events import read_events
    events = [e for e in read_events(Path(spec.run_dir) / EVENTS_FILE) if e.get("type") == "finished"]
    return events[-1] if events else None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    hide_optional_modules()
    if argv[:1] == ["--standby"]:  # started ahead of need by the launcher; becomes a trainer when given a run
        configure_logging()  # before the imports, as a run does: what they log goes to the run's log
        from .tasks.standby import serve
        return serve(argv[1:], main)
    parser = argparse.ArgumentParser(prog="ingraph-trainer", description="Train an adapter from a run spec.")
    parser.add_argument("--config", required=True, help="run spec (TOML) written by the Train node or by hand")
    parser.add_argument("--resume", default=None, metavar="latest|TAG",
                        help="continue from the newest complete checkpoint of the run directory, or from one tag")
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit when this process (the ComfyUI that launched the run) is gone")
    parser.add_argument("--parent-host", default="",
                        help="the machine --parent-pid lives on; ranks on other machines do not watch it")
    parser.add_argument("--signed-run", action="store_true",
                        help="the spec must be the one this installation signed in its run folder (the launcher's "
                             "runs: their folders sit under ComfyUI's output/, which any client can write)")
    parser.add_argument("--again", action="store_true",
                        help="train a run that already finished once more, from the start (its earlier result is "
                             "kept as <name>.previous.safetensors)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by deepspeed
    opts = parser.parse_args(argv)
    configure_logging()
    if not opts.signed_run:
        use_the_servers_secret()
    try:
        spec = load_signed_spec(opts.config) if opts.signed_run else load_run_spec(opts.config)
        if opts.resume is not None:  # the saved spec stays as it was given
            spec.train.resume = opts.resume
    except RunSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        report_spec_error(opts.config, exc)
        return EXIT_BAD_SPEC
    finished = finished_before(spec) if not opts.signed_run and opts.resume is None and not opts.again else None
    if finished is not None:  # by hand, on a run that is done: never trained again (and its LoRA replaced) unasked
        print(f"error: {spec.run_dir} already finished (its result: {finished.get('adapter')}); "
              "--resume latest continues it from its last checkpoint, --again trains it once more from the start",
              file=sys.stderr)
        return EXIT_BAD_SPEC
    reveal_modules_for(spec)

    from .parallel.distributed import destroy, ensure_dist_env, rank
    ensure_dist_env()
    from .device import choose_device, concrete_precision
    choose_device()  # before ComfyUI's import and the model: both take the current device
    spec.train.precision = concrete_precision(spec.train.precision)  # "auto": this device's answer
    run_dir = Path(spec.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # by hand (not launched by ComfyUI): the events also go to the terminal, one line each
    events = EventWriter(run_dir / EVENTS_FILE, enabled=rank() == 0, echo=not opts.signed_run and rank() == 0)
    start_parent_watchdog(opts.parent_pid, events, parent_host=opts.parent_host)
    try:
        if spec.task == "evaluate":
            from .tasks.evaluation import run_evaluation
            run_evaluation(spec, events)
        elif spec.task == "distill":
            from .tasks.distill import Distiller
            Distiller(spec, events).run()
        else:
            from .tasks.loop import Trainer
            Trainer(spec, events).run()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the node as an error event
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        events.emit("error", message=message, rank=rank(), traceback=tb[-4000:])
        # also written by every rank to its own file so that any rank's failure is visible
        (run_dir / f"error_rank{rank()}.txt").write_text(tb, encoding="utf-8")
        return EXIT_FAILED
    finally:
        destroy()
        events.close()
    return 0
