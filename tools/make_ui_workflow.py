"""Turn an API-format workflow into the UI (litegraph) format the ComfyUI frontend opens.

Needs a running ComfyUI with the pack (for /object_info):
    python tools/make_ui_workflow.py workflows/api/train_lora_api.json example_workflows/train_lora.json --server HOST:PORT
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
PANEL_NODES = {"InGraphTrainLoRA", "InGraphDistill"}  # nodes with the live panel (web/ingraph_trainer.js)
# a graph with a Train LoRA node opens with this note beside it: what its evaluation measures, when, and what it costs
EVALUATION_NOTE = (
    "What Train LoRA evaluates, and when\n\n"
    "The chart's eval points are the held-out loss of eval_items items (default 8: a fixed subset, drawn with the "
    "seed, of eval_dataset, or of the training images when none is wired) at each of the eval_quantiles points of "
    "the noise schedule (five by default), with fixed noise: the numbers compare across steps, runs and resumes.\n\n"
    "When: after the last step, and every eval_every steps (0: only at the end). Before step 1 only with "
    "eval_before; after a Stop only with eval_after_stop.\n\n"
    "Cost: one forward pass per item and quantile, 40 by default, about as long as 13 training steps of one image "
    "(a step is a forward and a backward pass). eval_items 0, or an empty eval_quantiles, turns it off.")
NOTE_TYPE = "Note"  # the frontend's own text node (no server class; ComfyUI's queue leaves it out)


def is_widget(spec) -> bool:
    kind = spec[0]
    options = spec[1] if len(spec) > 1 else {}
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput")


def _columns(api: dict) -> dict[str, int]:
    """Left to right by dependency depth: a node sits one column right of its deepest input."""
    depth: dict[str, int] = {}

    def of(key: str) -> int:
        if key not in depth:
            sources = [v[0] for v in api[key]["inputs"].values()
                       if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)]
            depth[key] = 1 + max((of(k) for k in sources), default=-1)
        return depth[key]
    return {key: of(key) for key in api}


def convert(api: dict, info: dict) -> dict:
    ids = {key: n for n, key in enumerate(api, start=1)}
    nodes, links = [], []
    out_links: dict[tuple[int, int], list[int]] = {}
    columns = _columns(api)
    next_y: dict[int, int] = {}  # per column: where the next node goes
    for key, node in api.items():
        spec = info[node["class_type"]]
        required, optional = spec["input"].get("required", {}), spec["input"].get("optional", {})
        order = spec.get("input_order", {})
        names = order.get("required", list(required)) + order.get("optional", list(optional))
        all_inputs = {**required, **optional}
        inputs, widgets = [], []
        for name in names:
            value = node["inputs"].get(name)
            ispec = all_inputs[name]
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                src, slot = ids[value[0]], value[1]
                link_id = len(links) + 1
                ltype = info[api[value[0]]["class_type"]]["output"][slot]
                links.append([link_id, src, slot, ids[key], len(inputs), ltype])
                out_links.setdefault((src, slot), []).append(link_id)
                entry = {"name": name, "type": ltype if not isinstance(ispec[0], list) else "COMBO", "link": link_id}
                if is_widget(ispec):
                    entry["widget"] = {"name": name}
                inputs.append(entry)
            elif is_widget(ispec):
                if name not in node["inputs"]:  # not in the API file: the input's default
                    options = ispec[1] if len(ispec) > 1 else {}
                    value = options.get("default", ispec[0][0] if isinstance(ispec[0], list) else None)
                widgets.append(value)
                if len(ispec) > 1 and ispec[1].get("control_after_generate"):
                    widgets.append("fixed")
        col = columns[key]
        # rough height: title, one line per socket or widget, multi-line text boxes, the Train node's panel; with
        # room to spare below, for a frontend that draws a node taller (an older ComfyUI's, which does not know a
        # newer node's type, draws its widget values as lines of their own: LTX-2's text encoder loader, 166 px)
        lines = max(len(inputs) + len(widgets), len(info[node["class_type"]]["output"]))
        height = 40 + 32 * lines + 60 * sum(isinstance(w, str) and "\n" in w for w in widgets) \
            + (230 if node["class_type"] in PANEL_NODES else 0)
        y = next_y.get(col, 60)
        next_y[col] = y + height + 80
        nodes.append({"id": ids[key], "type": node["class_type"], "pos": [40 + 380 * col, y],
                      "size": [340, height], "flags": {}, "order": ids[key] - 1, "mode": 0, "inputs": inputs,
                      "outputs": [], "properties": {"Node name for S&R": node["class_type"]},
                      "widgets_values": widgets, "title": node.get("_meta", {}).get("title")})
    for node in nodes:
        spec = info[node["type"]]
        node["outputs"] = [{"name": name, "type": otype, "links": out_links.get((node["id"], slot), []),
                            "slot_index": slot}
                           for slot, (name, otype) in enumerate(zip(spec["output_name"], spec["output"]))]
    ui = {"last_node_id": len(nodes), "last_link_id": len(links), "nodes": nodes, "links": links,
          "groups": [], "config": {}, "extra": {}, "version": 0.4}
    return with_evaluation_note(ui)


def with_evaluation_note(ui: dict) -> dict:
    """`ui` with EVALUATION_NOTE in a column of its own right of the graph, where it has a Train LoRA node and no
    such note yet (so that it is added once, to a converted graph or to a saved one)."""
    nodes = ui["nodes"]
    if not any(n["type"] == "InGraphTrainLoRA" for n in nodes) or \
            any(n["type"] == NOTE_TYPE and n["widgets_values"] == [EVALUATION_NOTE] for n in nodes):
        return ui
    node_id = max(n["id"] for n in nodes) + 1
    x = max(n["pos"][0] + n["size"][0] for n in nodes) + 40
    nodes.append({"id": node_id, "type": NOTE_TYPE, "pos": [x, 60], "size": [340, 420], "flags": {},
                  "order": len(nodes), "mode": 0, "inputs": [], "outputs": [], "properties": {},
                  "widgets_values": [EVALUATION_NOTE], "title": "Evaluation: what, when, cost"})
    ui["last_node_id"] = max(ui["last_node_id"], node_id)
    return ui


def main(argv=None):
    from client.api import ComfyClient
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("api_json", type=Path)
    parser.add_argument("ui_json", type=Path)
    parser.add_argument("--server", required=True)
    opts = parser.parse_args(argv)
    api = json.loads(opts.api_json.read_text())
    info = ComfyClient(opts.server).get("/object_info")
    opts.ui_json.write_text(json.dumps(convert(api, info), indent=1) + "\n")
    print(opts.ui_json)


if __name__ == "__main__":
    main()
