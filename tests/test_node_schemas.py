"""Every node's schema, input by input, against a snapshot (tests/data/node_schemas.json): saved workflows map
widget values by position and name, so a refactoring of how inputs reach the run spec must leave each input's
name, type, order, default, bounds, options and tooltip as they were. A deliberate change rewrites the snapshot:
`python tests/test_node_schemas.py --write`, and the diff shows what changed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).resolve().parent / "data" / "node_schemas.json"
# lists not written in the pack's code: read from the user's folders (runs, LoRAs), or ComfyUI's own (its samplers
# and schedulers, which differ between ComfyUI versions)
LISTED_ELSEWHERE = {("InGraphTrainLoRA", "resume"), ("InGraphDistill", "resume"), ("InGraphLoRAAdapter", "continue_from"),
                    ("InGraphCompare", "sampler_name"), ("InGraphCompare", "scheduler"),
                    ("InGraphSamplePreviews", "sampler_name"), ("InGraphSamplePreviews", "scheduler")}
FIELDS = ("optional", "default", "min", "max", "step", "options", "multiline", "tooltip", "display_name",
          "control_after_generate", "display_mode", "round")


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "value", str(value))  # an enum (display_mode)


def schemas() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tools.bootstrap import bootstrap
    bootstrap()
    from ingraph_trainer.nodes import NODES
    out = {}
    for node in NODES:
        schema = node.define_schema()
        inputs = []
        for item in schema.inputs:
            entry = {"id": item.id, "type": type(item).__qualname__}
            for name in FIELDS:
                value = getattr(item, name, None)
                if value is not None:
                    entry[name] = _plain(value)
            if (schema.node_id, item.id) in LISTED_ELSEWHERE and "options" in entry:
                entry["options"] = "listed elsewhere"
            inputs.append(entry)
        outputs = [{"type": type(o).__qualname__, "display_name": o.display_name, "tooltip": o.tooltip}
                   for o in schema.outputs]
        out[schema.node_id] = {"display_name": schema.display_name, "category": schema.category,
                               "description": schema.description, "output_node": bool(schema.is_output_node),
                               "inputs": inputs, "outputs": outputs,
                               "hidden": [_plain(h) for h in (schema.hidden or [])]}
    return out


def test_every_nodes_inputs_are_the_snapshots_input_by_input():
    expected = json.loads(SNAPSHOT.read_text())
    actual = schemas()
    assert sorted(actual) == sorted(expected), "the pack's node list changed"
    for node_id, schema in expected.items():
        now = actual[node_id]
        assert [i["id"] for i in now["inputs"]] == [i["id"] for i in schema["inputs"]], f"{node_id}: inputs' order"
        for before, after in zip(schema["inputs"], now["inputs"], strict=True):
            assert after == before, f"{node_id}.{before['id']}"
        assert now == schema, node_id


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    SNAPSHOT.write_text(json.dumps(schemas(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
