"""The coverage tier (issue 34): tools/family_coverage.py --train on the installed ComfyUI walks its model list
(comfy.supported_models.models), has the trainer program train every class a tiny model here is detected as, and
loads each adapter file with ComfyUI's LoRA loader. About 10 minutes a ComfyUI on 2 cores, so the suite leaves it
out; run it with

    INGRAPH_COVERAGE_TIER=1 pytest -m coverage                     (ComfyUI at COMFYUI_PATH)

after a ComfyUI update or a family change, and rewrite the tables with the tool's --markdown and --readme."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.coverage, pytest.mark.comfyui,
              pytest.mark.skipif(os.environ.get("INGRAPH_COVERAGE_TIER") != "1",
                                 reason="skipped: the coverage tier runs with INGRAPH_COVERAGE_TIER=1 (pytest -m "
                                        "coverage, ~10 minutes a ComfyUI)")]


def test_every_image_and_video_class_trains_and_loads_or_says_why(tmp_path):
    """Every image or video class of ComfyUI's list either trains 2 steps by the trainer program, its LoRA loading
    whole in ComfyUI and changing the output, or has its reason in the table; and the docs table of this ComfyUI
    (what the README's section is written from) says the same classes train."""
    out = tmp_path / "coverage.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "family_coverage.py"), "--train", "--json", str(out)],
                          capture_output=True, text=True, timeout=3600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    rows = [r for r in run["rows"] if r["kind"] in ("image", "video")]
    assert rows and any("yes" in r["trained"] for r in rows)
    trained = set()
    for r in rows:
        if "yes" in r["trained"]:
            trained.add(r["class"])
            assert "yes" in r["loads"] and any(c.startswith("yes") for c in r["changes"]), r
        else:
            assert r["why"], f"{r['class']}: not trained ({r['trained'] or 'no tiny model here'}) and no reason given"
    tables = [p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("coverage-comfyui-*.md"))]
    table = next(t for t in tables if t.startswith(f"ComfyUI {run['comfyui']}:"))  # the version's full number
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
             if line.startswith("| ") and "---" not in line]
    steps = cells[0].index("2 LoRA steps (trainer program)")
    assert {c[0] for c in cells[1:] if c[steps] == "yes"} == trained, "the docs table is another run's: rewrite it"
