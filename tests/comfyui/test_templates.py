"""The pack's graphs in ComfyUI's template browser (both ComfyUIs): the server lists exactly the UI graphs of
example_workflows/ under the pack's folder, each served whole, in the UI format the frontend opens, with a thumbnail;
no API-format file is listed (the browser opened those as an empty canvas: "Workflow does not contain a valid
version")."""
from __future__ import annotations

import json

import pytest

from conftest import REPO

pytestmark = pytest.mark.comfyui

UI_GRAPHS = sorted(p.stem for p in (REPO / "example_workflows").glob("*.json"))


def test_the_template_browser_lists_the_ui_graphs_alone(comfy, client):
    assert len(UI_GRAPHS) >= 3, UI_GRAPHS
    listed = client.get("/workflow_templates")
    pack = comfy.pack_name
    assert sorted(listed.get(pack, [])) == UI_GRAPHS, listed
    for name in UI_GRAPHS:
        served = client.get(f"/api/workflow_templates/{pack}/{name}.json")
        assert served == json.loads((REPO / "example_workflows" / f"{name}.json").read_text())
        # what the frontend checks before it opens a file: a UI graph, with its version, nodes and links
        assert "version" in served and served["nodes"] and "links" in served, name
        assert all("class_type" not in node for node in served["nodes"]), name


def test_every_template_has_a_thumbnail():
    for name in UI_GRAPHS:
        thumbnail = REPO / "example_workflows" / f"{name}.jpg"
        assert thumbnail.is_file() and thumbnail.read_bytes()[:3] == b"\xff\xd8\xff", thumbnail


def test_the_api_graphs_are_the_ui_graphs_in_api_form():
    """Every UI graph has its API form in workflows/api/ (the headless client and the tests run those), and
    nothing else is there."""
    api = sorted(p.name for p in (REPO / "workflows" / "api").glob("*.json"))
    assert api == sorted(f"{name}_api.json" for name in UI_GRAPHS)
    assert not list((REPO / "workflows").glob("*.json"))  # the template browser reads workflows/*.json too
