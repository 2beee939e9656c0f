"""Runs the trainer program's main on several run specs in turn, each in a child forked from one process that did
the program's imports once (~10 s of ComfyUI, DeepSpeed and peft on 2 cores): each run starts from the same fresh
process image, as `python trainer --config SPEC` would, without paying the imports again. For tests that compare
runs of the same program (tests/test_evaluation.py, tests/test_fp8.py).

    python tests/train_forked.py SPEC [SPEC ...]

Every run's output is this process's; the last line printed is {spec: exit status}; exits 0 when all were 0.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tools.prepare_run import _bootstrap  # noqa: E402  (the pack as the package ingraph_trainer)

_bootstrap()
from ingraph_trainer.trainer import main as trainer_main  # noqa: E402

trainer_main.hide_optional_modules()  # as the program does before its imports
import ingraph_trainer.trainer.evaluation  # noqa: E402,F401
import ingraph_trainer.trainer.loop  # noqa: E402,F401


def run_forked(spec: str) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            os.chdir(Path(spec).parent)  # where run_trainer starts the program
            rc = trainer_main.main(["--config", spec])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    # every run is tried (one failing does not hide the others' results); the last line maps spec to exit status
    statuses = {spec_path: run_forked(spec_path) for spec_path in sys.argv[1:]}
    print(json.dumps(statuses))
    sys.exit(0 if all(status == 0 for status in statuses.values()) else 1)
