"""Seconds per training step of each family's tiny model, read from the runs a test session left behind.

The family tests (tests/comfyui/test_model_families.py, test_image_families.py, test_video_families.py, ...) train every
family's tiny model through a real ComfyUI server; each run's events.jsonl names its family (started) and its steps'
times (step). This script finds those files under a folder (the suite's pytest temporary folder by default) and
prints, per family, the runs found and the median time of their steps after the first (the first step pays for
one-off set-up). Figures are "for the record": tiny models on this machine's CPU, measured by the suite's own runs.
A passing session removes its temporary folder (pyproject's tmp_path_retention_policy); one given with --basetemp
is kept:

    python -m pytest tests/comfyui/test_image_families.py --basetemp /tmp/family-runs
    python bench/family_step_times.py [FOLDER ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.run.events import EVENTS_FILE, read_events  # noqa: E402  (the trainer's own reader: no torch, no ComfyUI)


def runs_under(folder: Path):
    """(family, [step seconds after the first], run folder) of every finished training run below `folder`."""
    for events_file in folder.rglob(EVENTS_FILE):
        if not events_file.is_file():  # a test leaves a FIFO there: reading it would wait forever
            continue
        try:
            events = read_events(events_file)  # skips lines that are not events
        except OSError:
            continue
        family, times = None, []
        for event in events:
            if event["type"] == "started" and isinstance(event.get("family"), str):
                family = event["family"]
            elif event["type"] == "step" and family and isinstance(event.get("step_time_s"), (int, float)):
                times.append(float(event["step_time_s"]))
        if family and len(times) >= 2:
            yield family, times[1:], events_file.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path, default=[Path("/tmp/pytest-of-root")],
                        help="where to look for run folders (default: pytest's temporary folders)")
    opts = parser.parse_args(argv)
    per_family: dict[str, list[float]] = defaultdict(list)
    runs: dict[str, int] = defaultdict(int)
    for folder in opts.folders:
        for family, times, _ in runs_under(folder):
            per_family[family].extend(times)
            runs[family] += 1
    if not per_family:
        print(f"no finished training runs with 2 or more steps under {[str(f) for f in opts.folders]}", file=sys.stderr)
        return 1
    print(f"{'family':<16}{'runs':>6}{'steps':>7}{'median s/step':>15}")
    for family in sorted(per_family):
        times = per_family[family]
        print(f"{family:<16}{runs[family]:>6}{len(times):>7}{statistics.median(times):>15.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
