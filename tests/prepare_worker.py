"""tools/prepare_run.py's main, served to the test session: one JSON argv a line in, one JSON answer a line out.

Each prepare_run.py process spends ~8 s importing ComfyUI before its ~2 s of work; the suite prepares a few dozen
runs, so conftest's `prepared` keeps one of these workers and sends it the argv it would have run. The work itself
is prepare_run.main, unchanged, in a process of its own (the test process never imports ComfyUI).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # ComfyUI's and torch's prints go to the log, never into the answers
    sys.stdout = sys.stderr
    from tools import prepare_run
    for line in sys.stdin:
        argv = json.loads(line)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                prepare_run.main(argv)
            answer = {"ok": True, "stdout": printed.getvalue()}
        except BaseException as exc:  # argparse's SystemExit too: the test sees it as a failed prepare
            answer = {"ok": False, "stdout": printed.getvalue(),
                      "error": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    serve()
