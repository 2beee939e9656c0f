"""Runs the trainer program's main in children forked from one process that did the program's imports once (~12 s of
ComfyUI, torch, DeepSpeed and peft on 2 cores: those a standby trainer does, trainer/tasks/standby.py's warm_up): each run
starts from the same fresh process image, as a run handed to a standby does, without paying the imports again.

    python tests/helpers/train_forked.py SPEC [SPEC ...]     each spec in turn; the last line printed is {spec: exit status}
    python tests/helpers/train_forked.py --serve             one JSON request a line in, one JSON answer a line out

--serve is conftest's session trainer worker (run_trainer, run_trainers_forked): a request
{"argv": [...], "cwd": DIR, "timeout": S, "processes": N, "env": {...}, "patch": MODULE, "program": MODULE, "kill_on": EVENT} runs the program's main on that argv in a forked child
(N > 1: N ranks, as the DeepSpeed launcher starts them on one machine) whose stdout and stderr are its own files,
killed by SIGALRM after S seconds; the answer is {"returncode", "stdout", "stderr"}.
The program's own start (its imports, `python trainer` as a path) is still what the standby, trainer-program
start-up and launcher tests (tests/trainer/test_standby.py, tests/trainer/test_trainer_program.py's two-step run,
tests/trainer/test_distributed.py) run.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.prepare_run import _bootstrap  # noqa: E402  (the pack as the package ingraph_trainer)

_bootstrap()
from ingraph_trainer.trainer import main as trainer_main  # noqa: E402

trainer_main.hide_optional_modules()  # as the program does before its imports


def warm_up():
    """A standby trainer's imports (trainer/tasks/standby.py), the launching ComfyUI's included (without them every run
    paid ComfyUI's import, ~5 s on 2 cores, again in its child); logging configured first, as a standby does."""
    import torch
    trainer_main.configure_logging()
    if torch.cuda.is_available():  # ComfyUI's import starts CUDA, which a forked child cannot use: trainer only
        from ingraph_trainer.trainer.tasks import evaluation, loop  # noqa: F401
        return
    from ingraph_trainer.trainer.tasks.standby import warm_up as standby_warm_up
    standby_warm_up()


def run_forked(argv: list[str], cwd: str, timeout: float = 0, output: tuple[int, int] | None = None,
               processes: int = 1, env: dict[str, str] | None = None, patch: str | None = None,
               program: str | None = None, kill_on: str | None = None) -> int:
    """The program's main on argv in forked children started in cwd; the exit status (negative: killed by that
    signal). `output`: file descriptors the children's stdout and stderr go to. `processes` > 1: that many ranks
    of one machine, each given the variables and `--local_rank` the DeepSpeed launcher gives its ranks; when one
    fails the others are killed, as that launcher does. `env`: variables set in the children; `patch`: a module
    beside this file whose install() the children call before main (tests/helpers/inject_nan.py); `program`: a module
    beside this file whose main(argv) runs instead of the trainer's (tests/helpers/optimizer_runs.py), the optional modules
    importable, as in a script of its own; `kill_on`: an event type: once the run's events.jsonl (in cwd) holds one,
    the children are SIGKILLed (tests of a killed run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    rank_env = {}
    if processes > 1:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rank_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(processes),
                    "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(processes)}
    pids = []
    for rank in range(processes):
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                if output:
                    os.dup2(output[0], 1)
                    os.dup2(output[1], 2)
                    sys.stdout = sys.__stdout__  # the serving parent pointed it at stderr
                if timeout:
                    import signal
                    signal.signal(signal.SIGALRM, signal.SIG_DFL)
                    signal.alarm(max(1, int(timeout)))
                os.chdir(cwd)  # where run_trainer starts the program
                if rank_env:
                    os.environ.update(rank_env, RANK=str(rank), LOCAL_RANK=str(rank))
                os.environ.update(env or {})
                if patch:
                    import importlib
                    importlib.import_module(patch).install()
                if program:
                    for name in trainer_main.OPTIONAL_MODULES:  # a script of its own never hid them
                        if name in sys.modules and sys.modules[name] is None:
                            del sys.modules[name]
                    import importlib
                    rc = importlib.import_module(program).main(argv) or 0
                else:
                    rc = trainer_main.main([*argv, f"--local_rank={rank}"] if rank_env else argv)
            except SystemExit as exc:  # argparse's errors, as the program would exit with them
                rc = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # as an uncaught exception ends a program: the traceback on stderr, status 1
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc if isinstance(rc, int) else 1)
        pids.append(pid)
    status = 0
    while pids:
        pid, wait_status = os.waitpid(-1, os.WNOHANG if kill_on else 0)
        if pid == 0:  # kill_on: all still running
            if _has_event(Path(cwd) / "events.jsonl", kill_on):
                for child in pids:
                    os.kill(child, 9)
                kill_on = None
            else:
                import time
                time.sleep(0.05)
            continue
        if pid not in pids:
            continue
        pids.remove(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code
            for other in pids:
                try:
                    os.kill(other, 9)
                except ProcessLookupError:
                    pass
    return status


def _has_event(path: Path, kind: str) -> bool:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            if json.loads(line).get("type") == kind:
                return True
        except ValueError:  # a line being written
            pass
    return False


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the imports print goes to the log, never into the answers
    sys.stdout = sys.stderr
    warm_up()
    for line in sys.stdin:
        request = json.loads(line)
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out, \
                tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err:
            rc = run_forked(request["argv"], request["cwd"], request.get("timeout", 0), (out.fileno(), err.fileno()),
                            request.get("processes", 1), request.get("env"), request.get("patch"),
                            request.get("program"), request.get("kill_on"))
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read())
        answers.write(json.dumps({"returncode": rc, "stdout": texts[0], "stderr": texts[1]}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
        sys.exit(0)
    warm_up()
    # every run is tried (one failing does not hide the others' results); the last line maps spec to exit status
    statuses = {spec: run_forked(["--config", spec], str(Path(spec).parent)) for spec in sys.argv[1:]}
    print(json.dumps(statuses))
    sys.exit(0 if all(status == 0 for status in statuses.values()) else 1)
