"""Every node's schema, input by input, against a snapshot (tests/data/node_schemas.json): saved workflows map
widget values by position and name, so a refactoring of how inputs reach the run spec must leave each input's
name, type, order, default, bounds, options and tooltip as they were. A deliberate change rewrites the snapshot:
`python tests/unit/test_node_schemas.py --write`, and the diff shows what changed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfyui  # the nodes import ComfyUI's comfy_api

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "node_schemas.json"
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
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools.bootstrap import bootstrap
    bootstrap()
    from ingraph_trainer.nodes import NODES
    out = {}
    for node in NODES:
        schema = node.define_schema()
        inputs = []
        for item in schema.inputs:
            entry = {"id": item.id, "type": item.get_io_type()}
            for name in FIELDS:
                value = getattr(item, name, None)
                if value is not None:
                    entry[name] = _plain(value)
            if (schema.node_id, item.id) in LISTED_ELSEWHERE and "options" in entry:
                entry["options"] = "listed elsewhere"
            inputs.append(entry)
        outputs = [{"type": o.get_io_type(), "display_name": o.display_name, "tooltip": o.tooltip}
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


# the inputs of the trainer nodes that are not a spec setting: what the run reads (the graph's values, the run to
# resume, the output's name), handed to runner.node_run.run_task beside the draft spec
NOT_SETTINGS = {"model", "dataset", "adapter", "distributed", "eval_dataset", "prior_dataset", "previews",
                "output_name", "resume", "baseline"}


def _other_value(item):
    """A valid value of the input other than its default."""
    kind, default = item.get_io_type(), item.default
    if kind == "BOOLEAN":
        return not default
    if kind == "COMBO":
        return next(o for o in item.options if o != default)
    if kind == "STRING":
        return {"eval_quantiles": "0.25, 0.75", "quantiles": "0.25, 0.75",
                "student_timesteps": "1.0, 0.75, 0.5, 0.25"}[item.id]
    low, high = item.min, item.max
    if kind == "INT":
        return default + 1 if default + 1 <= high else default - 1
    other = default * 1.5 if default else (low + high) / 7
    return other if low <= other <= high else (low + default) / 2


# the inputs read otherwise than cast or looked up as a choice: what _other_value's values are read as
READ_AS = {"eval_quantiles": [0.25, 0.75], "quantiles": [0.25, 0.75], "student_timesteps": [1.0, 0.75, 0.5, 0.25],
           "save_ema": "ema"}


def _flat(spec) -> dict:
    import dataclasses
    return {f"{table}.{key}": value for table, section in dataclasses.asdict(spec).items()
            if isinstance(section, dict) for key, value in section.items()}


def test_each_trainer_node_input_reaches_its_spec_field_and_no_other(monkeypatch):
    """The one carrier (nodes/spec_inputs.py): every input of Train LoRA, Distill and Evaluate but the run's own
    (NOT_SETTINGS) changes exactly one field of the draft spec the node hands the runner, the field of its name or
    the node's SPEC_INPUTS entry, to the value it means; an input that reached no field, or two, fails here."""
    import types
    schemas()  # bootstrapped
    from ingraph_trainer.nodes.distill_node import Distill
    from ingraph_trainer.nodes.evaluate_node import Evaluate
    from ingraph_trainer.nodes.train_node import TrainLoRA
    from ingraph_trainer.runner import node_run
    from ingraph_trainer.trainer.spec import CHOICE_FIELDS, AdapterSpec, choice_value

    class Handed(Exception):
        pass

    def run_task(draft, *args, **kwargs):
        raise Handed(draft)

    monkeypatch.setattr(node_run, "run_task", run_task)
    dataset = types.SimpleNamespace(require_cached=lambda name: None)
    for node, least in ((TrainLoRA, 30), (Distill, 15), (Evaluate, 5)):
        monkeypatch.setattr(node, "hidden", types.SimpleNamespace(unique_id="1", prompt=None), raising=False)
        inputs = [i for i in node.define_schema().inputs if i.id not in NOT_SETTINGS]
        assert len(inputs) >= least, node
        inputs_of_the_run = {} if node is Evaluate else {"adapter": AdapterSpec(), "output_name": "carrier"}

        def draft_of(**given):
            try:
                node.execute(object(), dataset, **inputs_of_the_run, **given)
            except Handed as handed:
                return _flat(handed.args[0])
            raise AssertionError(f"{node.__name__} did not hand the runner a draft")
        defaults = draft_of()
        fields = {v: k for k, v in node.SPEC_INPUTS.items() if v}
        for item in inputs:
            given = _other_value(item)
            draft = draft_of(**{item.id: given})
            changed = [k for k, v in draft.items() if v != defaults[k]]
            expected = fields.get(item.id) or next(k for k in changed if k.endswith(f".{item.id}")) if changed else None
            assert changed == [expected], f"{node.__name__}.{item.id}={given!r} changed {changed}"
            # and to the value the input means: a label read as its spec value, text as its list, a number as given
            value = READ_AS[item.id] if item.id in READ_AS else \
                choice_value(CHOICE_FIELDS[expected], given, item.id) if expected in CHOICE_FIELDS else given
            assert draft[expected] == value and type(draft[expected]) is type(value), (item.id, draft[expected])


def test_the_train_nodes_settings_the_spec_refuses_name_its_inputs_before_the_model_is_handed_off(monkeypatch):
    """The spec's own rules on the node's draft (runner.node_run.settings_problems), before the hand-off (which
    can take minutes): each problem names the node's input (renamed fields too), not the spec's field."""
    import types
    schemas()  # bootstrapped
    from ingraph_trainer.nodes.train_node import TrainLoRA
    from ingraph_trainer.runner import model_source
    from ingraph_trainer.trainer.spec import AdapterSpec

    def hand_off(*args, **kwargs):
        raise AssertionError("a refused run was handed off")
    monkeypatch.setattr(model_source, "hand_off_model", hand_off)
    monkeypatch.setattr(TrainLoRA, "hidden", types.SimpleNamespace(unique_id="1", prompt=None), raising=False)
    dataset = types.SimpleNamespace(require_cached=lambda name: None)

    def refused(**inputs):
        try:
            TrainLoRA.execute(object(), dataset, AdapterSpec(), output_name="refused_probe", **inputs)
        except ValueError as error:
            return str(error)
        raise AssertionError(f"{inputs} was not refused")
    assert refused(gradient_accumulation=0).startswith("Train LoRA: gradient_accumulation: must be at least 1")
    assert refused(save_ema=True).startswith("Train LoRA: save_ema: 'ema' needs the average kept")
    assert refused(weight_decay=-1.0).startswith("Train LoRA: weight_decay: must be 0 or more")
