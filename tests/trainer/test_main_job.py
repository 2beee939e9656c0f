"""The main job (`scripts/main_job.sh`) as a user runs it: it sets up, trains through a real headless ComfyUI,
prints where the LoRA, the run folder, the loss chart and the sample are, and leaves those under `output/`
(ComfyUI empties `temp/` at every start), with no process it started still alive once it has exited."""
from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.comfyui


def processes_marked(mark: str) -> list[str]:
    """The processes whose environment carries `mark` (every process the job started inherits it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in environ.read_bytes():
                found.append(environ.parent.name)
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return found


def test_the_main_job_keeps_its_results_under_output_and_leaves_no_process_behind(tmp_path):
    mark = f"INGRAPH_MAIN_JOB_MARK=main-job-{uuid.uuid4().hex}"
    base = tmp_path / "job"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "main_job.sh"), "--steps", "2", "--base-dir", str(base)],
                          env=dict(os.environ, **dict([mark.split("=", 1)])), capture_output=True, text=True,
                          timeout=900)
    left = processes_marked(mark)  # at once: the job is over only when nothing of it runs
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    said = dict(line.split(": ", 1) for line in proc.stdout.splitlines()
                if line.startswith(("LoRA written to", "run folder", "loss chart", "sample with the trained LoRA")) and ": " in line)
    assert "LoRA written to /" in proc.stdout and "Train LoRA" in proc.stdout, proc.stdout[-3000:]  # it trained
    chart, sample = Path(said["loss chart"]), Path(said["sample with the trained LoRA"])
    for path in (chart, sample):
        assert path.is_file() and path.stat().st_size > 0, path
        assert path.resolve().is_relative_to((base / "output").resolve()), path
    assert not left, subprocess.run(["ps", "-o", "pid,ppid,etime,args", "-p", ",".join(left)],
                                    capture_output=True, text=True).stdout
