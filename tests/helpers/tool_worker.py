"""tools/prepare_run.py's, tools/cache_dataset.py's, tools/diffusers_roundtrip.py's and tools/family_coverage.py's main,
and the test-asset builders' (tools/embedded_default.py, tools/tiny_models.py), served to the test session: one
JSON request a line in ({"tool": "prepare_run", "argv": [...]}; with "copies": N, N children run it at once and the
answer is the list of their answers), one JSON answer a line out.

Each of those tools spends ~8 s importing ComfyUI before its ~2 s of work, and the suite runs them a few dozen
times, so conftest keeps one of these workers (the `tools` fixture): it imports once, then forks a child per
request that runs the tool's own main, unchanged, and exits. Each run thus starts from the same fresh process
image, as a newly started tool would (nothing a run loads or allocates reaches the next; a fresh image matters:
the tiny checkpoint's CLIP has a weight ComfyUI leaves uninitialised, which the text cache's key samples).
Two caching at once are two such children at once (copies); the test of a tool killed mid-cache still starts the
tool itself.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

# A worker that forks must not have started CUDA (a forked child cannot use it), and ComfyUI's import starts it
# on a GPU machine: the tools it serves (caching, test-asset builders) run on the CPU, as the suite's ComfyUI
# server does (--cpu). Trainers the tests launch are other processes and keep the GPU.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
# diffusers_roundtrip imports diffusers in its child; the builders make the tiny checkpoint, models and VAEs
TOOLS = ("prepare_run", "cache_dataset", "diffusers_roundtrip", "embedded_default", "tiny_models", "quantized_models",
         "family_coverage")


def run_in_child(request: dict, answer_fd: int) -> None:
    printed = io.StringIO()
    try:
        if request["tool"] not in TOOLS:
            raise ValueError(f"tests/helpers/tool_worker.py serves {TOOLS}, not {request['tool']!r}")
        tool = importlib.import_module(f"tools.{request['tool']}")
        with contextlib.redirect_stdout(printed):
            tool.main(request["argv"])
        answer = {"ok": True, "stdout": printed.getvalue()}
    except BaseException as exc:  # argparse's SystemExit too: the test sees a failed run of the tool
        answer = {"ok": False, "stdout": printed.getvalue(),
                  "error": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}
    with os.fdopen(answer_fd, "w") as out:
        out.write(json.dumps(answer))


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # ComfyUI's and torch's prints go to the log, never into the answers
    sys.stdout = sys.stderr
    from tools.bootstrap import bootstrap
    bootstrap()
    for name in TOOLS:  # what every run would import (ComfyUI, torch, the pack): once, before any fork
        importlib.import_module(f"tools.{name}")
    import comfy.sd  # noqa: F401
    import comfy.utils  # noqa: F401
    for line in sys.stdin:
        request = json.loads(line)
        children = []
        for _ in range(request.get("copies", 1)):  # copies run at once, each its own process
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                try:
                    if request.get("copies", 1) > 1:  # copies share the cores: oversubscribed, torch's threads
                        # wait on each other (two 2-thread copies on 2 cores took 15-60 s where 1-thread ones took 7)
                        from ingraph_trainer.trainer.parallel.distributed import set_cpu_threads
                        set_cpu_threads(max(1, len(os.sched_getaffinity(0)) // request["copies"]))
                    run_in_child(request, write_fd)
                finally:
                    sys.stderr.flush()
                    os._exit(0)
            os.close(write_fd)
            children.append((pid, read_fd))
        texts = []
        for pid, read_fd in children:
            with os.fdopen(read_fd) as child_answer:
                text = child_answer.read()
            _, status = os.waitpid(pid, 0)
            texts.append(text or json.dumps({"ok": False, "stdout": "",
                                             "error": f"the child died (wait status {status})"}))
        answers.write((texts[0] if "copies" not in request else "[" + ",".join(texts) + "]") + "\n")

if __name__ == "__main__":
    serve()
