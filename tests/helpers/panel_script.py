"""The web panel's scripts (web/*.js) run in Node, without a browser or a server: the extension folder as ComfyUI
serves it, beside stand-ins for the frontend's app.js and api.js, and a driver script that prints one JSON line."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

# what the panel imports of ComfyUI's frontend; a driver reads `registered` to see what the extension registered
APP_JS = "export const registered = []; export const app = { registerExtension(e) { registered.push(e); } };\n"
API_JS = ("export const api = { apiURL: (p) => p, fetchApi: async () => ({ json: async () => ({}) }),"
          " addEventListener() {} };\n")


def run_panel_script(folder: Path, driver: str, timeout: float = 60) -> dict:
    """The last line `driver` (a Node ES module beside ext/pack/, the pack's web scripts) prints, as JSON; skipped
    where Node is not installed."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    (folder / "ext" / "pack").mkdir(parents=True)
    for script in (REPO / "web").glob("*.js"):
        shutil.copy(script, folder / "ext" / "pack" / script.name)
    (folder / "scripts").mkdir()  # what "../../scripts/app.js" finds beside the extension folder
    (folder / "scripts" / "app.js").write_text(APP_JS)
    (folder / "scripts" / "api.js").write_text(API_JS)
    (folder / "package.json").write_text('{"type": "module"}')
    (folder / "drive.js").write_text(driver)
    out = subprocess.run([node, "drive.js"], cwd=folder, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
