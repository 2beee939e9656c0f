"""The web extension in headless Chromium against the real ComfyUI frontend (screenshot saved)."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from conftest import ARTIFACTS, REPO

pytestmark = pytest.mark.comfyui

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_panel_shows_rising_steps_and_a_loss_chart(comfy, tmp_path):
    from playwright.sync_api import sync_playwright
    # the train + evaluate + compare workflow: the panel also charts evaluations and shows previews
    workflow = json.loads((REPO / "workflows" / "train_evaluate_compare.json").read_text())
    train = next(n for n in workflow["nodes"] if n["type"] == "InGraphTrainLoRA")
    from client.api import ComfyClient
    info = ComfyClient(comfy.address).get("/object_info/InGraphTrainLoRA")["InGraphTrainLoRA"]
    linked = {i["name"] for i in train["inputs"]}
    order = info["input_order"]
    widgets = [n for n in order["required"] + order.get("optional", []) if n not in linked]
    train["widgets_values"][widgets.index("steps")] = 40
    train["widgets_values"][widgets.index("output_name")] = "browser_test_lora"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    settings = comfy.dir("user", "default") / "comfy.settings.json"  # a returning user: no template dialog
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    console = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.goto(f"http://{comfy.address}/", wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_function("() => window.app && window.app.graph && window.app.extensionManager", timeout=60_000)
            page.wait_for_function(
                "() => (window.app.extensions || []).some(e => e.name === 'ingraph.trainer.panel')"
                " || (window.app.extensionManager && true)", timeout=30_000)
            page.keyboard.press("Escape")
            page.evaluate("async (wf) => { await window.app.loadGraphData(wf); }", workflow)
            page.wait_for_selector(".ingraph-panel", state="attached", timeout=30_000)
            # the panel may first show an older run of a node with the same id (restored from the run records)
            run_of = "() => window.app.graph._nodes.find(n => n.type === 'InGraphTrainLoRA').ingraphPanel.runId"
            old_run = page.evaluate(run_of)
            page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")

            step_of = ("() => { const s = document.querySelector('.ingraph-panel [data-role=step]');"
                       " const m = s && s.textContent.match(/^(\\d+) \\/ (\\d+)$/); return m ? Number(m[1]) : 0; }")
            page.wait_for_function(f"() => ({run_of})() !== {json.dumps(old_run)} && ({step_of})() >= 1",
                                   timeout=180_000)
            first = page.evaluate(step_of)
            page.wait_for_function(f"() => ({step_of})() >= {min(first + 3, 40)}", timeout=120_000)
            later = page.evaluate(step_of)
            points = int(page.get_attribute(".ingraph-panel canvas[data-role=chart]", "data-points"))
            assert (later > first or first == 40) and points >= later - 1 and points > 0
            # reload mid-run: the panel rebuilds its history from the run record and keeps following
            page.reload(wait_until="domcontentloaded")
            page.wait_for_function("() => window.app && window.app.graph", timeout=60_000)
            page.keyboard.press("Escape")
            page.wait_for_selector(".ingraph-panel", state="attached", timeout=30_000)
            page.wait_for_function(
                f"() => Number(document.querySelector('.ingraph-panel canvas[data-role=chart]').dataset.points) >= {later}",
                timeout=60_000)
            page.wait_for_function(
                "() => /finished/.test(document.querySelector('.ingraph-panel [data-role=state]').textContent)",
                timeout=180_000)
            # previews at steps 20 and 40, two prompts each, loaded from the run's samples route
            page.wait_for_function("() => [...document.querySelectorAll('.ingraph-panel [data-role=samples] img')]"
                                   ".filter(i => i.complete && i.naturalWidth === 64).length === 4", timeout=30_000)
            # centre the view on the Train node so the screenshot shows the panel
            page.evaluate("""() => { const n = window.app.graph._nodes.find(n => n.type === 'InGraphTrainLoRA');
                const c = window.app.canvas; c.ds.scale = 1.0;
                c.ds.offset[0] = -n.pos[0] + 500; c.ds.offset[1] = -n.pos[1] + 120; c.setDirty(true, true); }""")
            time.sleep(0.5)  # one animation frame for the canvas redraw before the screenshot
            page.screenshot(path=str(ARTIFACTS / "web_panel.png"))
            final_points = int(page.get_attribute(".ingraph-panel canvas[data-role=chart]", "data-points"))
            assert final_points == 40
            assert int(page.get_attribute(".ingraph-panel canvas[data-role=chart]", "data-evals")) == 5  # 0, 10, .. 40
            text = page.inner_text(".ingraph-panel")
            assert "40 / 40" in text and "img/s" in text
            # the rest of the workflow (Evaluate, Compare) finishes before the next test uses the server
            client = ComfyClient(comfy.address)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and (client.get("/queue")["queue_running"] or client.get("/queue")["queue_pending"]):
                time.sleep(0.5)
            assert not client.get("/queue")["queue_running"]
        finally:
            (ARTIFACTS / "web_console.log").write_text("\n".join(console))
            browser.close()
