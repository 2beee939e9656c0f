"""ComfyUI tier: the pack inside a real headless ComfyUI, driven through its HTTP and websocket API."""
from __future__ import annotations

import copy
import os
import re
import signal
import time
import urllib.error
from pathlib import Path

import pytest
from safetensors.torch import load_file

from client.api import PromptRejected
from conftest import REPO, evaluate_on_one_image, load_workflow, wait_first_step
from waiting import wait_until

pytestmark = pytest.mark.comfyui

TRAIN_STEPS = 20
LEARNS_THRESHOLD = 0.85  # fixed-noise loss after training must be below 85% of the loss before


def training_workflow(output_name: str, steps: int = TRAIN_STEPS, **train_inputs) -> dict:
    wf = load_workflow()
    wf["6"]["inputs"].update(steps=steps, output_name=output_name, **train_inputs)
    return wf


def only_training(wf: dict) -> dict:
    """The workflow without its sampling tail (faster where the sample is not the point)."""
    return {k: v for k, v in wf.items() if k in {"1", "2", "3", "4", "5", "6", "7"}}


def ingraph_events(outcome, kind=None):
    events = [m["data"]["event"] for m in outcome.messages if m.get("type") == "ingraph.event"]
    return [e for e in events if kind is None or e["type"] == kind]


@pytest.fixture(scope="module")
def trained(comfy):
    from client.api import ComfyClient
    client = ComfyClient(comfy.address)
    # fp32: bf16 convolutions are several times slower on CPU, and precision is not what these tests check (the
    # shipped bf16 setting still trains in the interrupt and killed-trainer tests)
    wf = training_workflow("test_trained", precision="fp32")
    wf["6"]["inputs"]["eval_before"] = True  # test_training_learns compares with the loss before step 1
    outcome = client.run(wf, timeout=600)
    client.close()
    assert outcome.ok, (outcome.status, outcome.error, comfy.log_tail())
    return outcome, wf


def test_api_workflow_trains_with_progress_for_the_train_node(trained):
    outcome, _ = trained
    progress = [d for d in outcome.of_type("progress") if d.get("node") == "6"]
    assert progress, "no progress messages for the Train node"
    assert all(d["max"] == TRAIN_STEPS for d in progress)
    assert progress[-1]["value"] == TRAIN_STEPS
    steps = [e["step"] for e in ingraph_events(outcome, "step")]
    assert steps == list(range(1, TRAIN_STEPS + 1))
    executed = {d["node"] for d in outcome.of_type("executed")}
    assert {"7", "13"} <= executed  # the loss chart and the sample from the trained MODEL were produced


def test_the_loss_chart_and_the_sample_last_under_output(trained, comfy):
    """ComfyUI empties temp/ at every start: the loss chart is also kept in the run's folder, and the shipped
    graph saves its sample (SaveImage) to output/."""
    outcome, wf = trained
    run_dir = Path(ingraph_events(outcome, "started")[0]["run_dir"])
    output = (comfy.base_dir / "output").resolve()
    chart = run_dir / "loss_chart.png"
    assert chart.resolve().is_relative_to(output) and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = [i for d in outcome.of_type("executed") if d["node"] == "13" for i in d["output"]["images"]]
    assert saved and all(i["type"] == "output" for i in saved), saved
    assert (output / saved[0]["subfolder"] / saved[0]["filename"]).is_file()


def test_comfyui_holds_no_loaded_model_as_the_trainer_starts(trained, comfy):
    """The graph's VAE and CLIP were loaded to cache the dataset; the Train node unloads them and the model it
    trains before the trainer starts, on each ComfyUI (0.33 keeps the current workflow's models loaded)."""
    log = comfy.log_text()
    assert "ComfyUI holds 0 loaded model(s) as the trainer starts (the trained model: not loaded)" in log, \
        comfy.log_tail()


def test_lora_is_listed_and_has_every_adapted_module_with_its_alpha(trained, comfy, client, assets):
    outcome, wf = trained
    path = comfy.base_dir / "models" / "loras" / "test_trained.safetensors"
    assert path.is_file() and (path.stat().st_mode & 0o777) == 0o644
    listed = client.get("/object_info/LoraLoader")["LoraLoader"]["input"]["required"]["lora_name"][0]
    assert "test_trained.safetensors" in listed
    tensors = load_file(path)
    started = ingraph_events(outcome, "started")[0]
    modules = {k[: -len(".lora_down.weight")] for k in tensors if k.endswith(".lora_down.weight")}
    from safetensors import safe_open
    with safe_open(str(assets["checkpoint"]), "pt") as f:  # every attention projection of the checkpoint's UNet
        expected = {k[len("model."):-len(".weight")] for k in f.keys()
                    if re.search(r"^model\.diffusion_model\..*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)\.weight$", k)}
    assert modules == expected and len(modules) == started["adapted_modules"]
    alpha = wf["5"]["inputs"]["alpha"]
    for module in modules:
        assert tensors[f"{module}.alpha"].item() == alpha
        assert f"{module}.lora_up.weight" in tensors


def test_training_learns(trained):
    outcome, _ = trained
    evals = ingraph_events(outcome, "eval")
    assert [e["step"] for e in evals] == [0, TRAIN_STEPS]
    before, after = evals[0]["loss"], evals[-1]["loss"]
    assert after < LEARNS_THRESHOLD * before, (before, after)


def lora_loader_workflow(lora_name: str, strength: float, prefix: str) -> dict:
    wf = load_workflow()
    tail = {k: copy.deepcopy(wf[k]) for k in ("1", "8", "9", "10", "11", "12")}
    tail["20"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_name": lora_name,
                                                          "strength_model": strength, "strength_clip": 0.0}}
    tail["11"]["inputs"]["model"] = ["20", 0]
    tail["21"] = {"class_type": "SaveImage", "inputs": {"images": ["12", 0], "filename_prefix": prefix}}
    return tail


def test_stock_lora_loader_loads_it_and_changes_the_image(trained, comfy, client):
    import numpy as np
    from PIL import Image
    images = {}
    for strength in (1.0, 0.0):
        prefix = f"lora_strength_{strength}"
        outcome = client.run(lora_loader_workflow("test_trained.safetensors", strength, prefix), timeout=300)
        assert outcome.ok, outcome.error
        saved = sorted((comfy.base_dir / "output").glob(f"{prefix}_*.png"))
        images[strength] = np.asarray(Image.open(saved[-1]), dtype=np.int16)
    assert np.abs(images[1.0] - images[0.0]).max() > 0
    assert "lora key not loaded" not in comfy.log_text()


def test_bad_inputs_fail_the_node_naming_the_culprit_and_write_no_lora(comfy, client, tmp_path):
    loras = comfy.base_dir / "models" / "loras"
    folder = comfy.dir("input", "bad_sets")

    def fails_with(dataset_inputs: dict, needle: str, name: str):
        wf = only_training(training_workflow(name, steps=2))
        wf["2"]["inputs"].update(dataset_inputs)
        outcome = client.run(wf, timeout=300)
        assert outcome.status == "execution_error", outcome.status
        assert outcome.error["node_id"] == "2"
        assert re.search(needle, outcome.error["exception_message"]), outcome.error["exception_message"]
        assert outcome.error["exception_message"].startswith("Load Training Images: ")  # the title, not the class id
        assert not (loras / f"{name}.safetensors").exists()
        return outcome.error["exception_message"]

    fails_with({"folder": "no_such_folder"}, r"no_such_folder does not exist", "bad1")
    # any client can queue a graph: a folder outside input/ (and the operator's INGRAPH_DATASET_ROOTS) is refused
    # before anything in it is listed or read
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "secret_name.png").write_bytes((comfy.base_dir / "input" / "ingraph_example" /
                                               "item_000.png").read_bytes())
    for inputs in ({"folder": str(outside)}, {"folder": "../output"},
                   {"folder": "bad_sets/../../models", "missing_caption": "use default caption"},
                   {"reference_folder": str(outside)}):
        name = next(iter(inputs))
        message = fails_with(inputs, rf"{name} '.*' is outside ComfyUI's input folder: datasets come from input/",
                             "bad0")
        assert "secret_name" not in message
    (folder / "empty").mkdir()
    fails_with({"folder": "bad_sets/empty"}, r"empty contains no images", "bad2")
    corrupt = folder / "corrupt"
    corrupt.mkdir()
    (corrupt / "x.png").write_bytes(b"not a png at all")
    (corrupt / "x.txt").write_text("caption")
    fails_with({"folder": str(corrupt)}, r"cannot read image .*corrupt/x\.png", "bad3")
    uncaptioned = folder / "uncaptioned"
    uncaptioned.mkdir()
    src = comfy.base_dir / "input" / "ingraph_example" / "item_000.png"
    (uncaptioned / "lonely.png").write_bytes(src.read_bytes())
    (uncaptioned / "notes.md").write_text("not an image")
    fails_with({"folder": "bad_sets/uncaptioned"}, r"lonely\.png has no caption file", "bad4")

    # the same folder trains when a default caption is allowed; the non-image file is ignored and logged
    wf = only_training(training_workflow("default_caption", steps=1, precision="fp32"))  # bf16: the killed-trainer test
    wf["2"]["inputs"].update(folder="bad_sets/uncaptioned", missing_caption="use default caption",
                             default_caption="a lonely square")
    outcome = client.run(wf, timeout=300)
    assert outcome.ok, outcome.error
    assert (loras / "default_caption.safetensors").is_file()
    assert re.search(r"ignored 1 non-image file\(s\) in .*uncaptioned: notes\.md", comfy.log_text())


@pytest.mark.parametrize("node,field,value", [("5", "rank", 0), ("6", "steps", 0)])
def test_rank_or_steps_below_one_are_rejected_before_running(client, comfy, node, field, value):
    wf = only_training(training_workflow(f"rejected_{field}", steps=2))
    wf[node]["inputs"][field] = value
    with pytest.raises(PromptRejected) as info:
        client.queue(wf)
    errors = info.value.body["node_errors"][node]["errors"]
    assert any(e["extra_info"]["input_name"] == field for e in errors)
    assert not (comfy.base_dir / "models" / "loras" / f"rejected_{field}.safetensors").exists()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_killed_trainer_fails_the_node_then_a_requeue_trains_and_interrupt_stops_it_within_3s(comfy, client):
    """A SIGKILLed trainer fails its node within 5 s naming its log, and the server keeps serving; re-queueing the
    same graph trains again (no cached failure), and that run is the one POST /interrupt stops: no process of its
    group survives 3 s later (one trainer launch serves both, since each costs ~20 s)."""
    wf = only_training(training_workflow("killed", steps=5000))
    # the shipped bf16 setting trains here; the evaluation before step 1 (bf16 convolutions are several times slower
    # on CPU) runs on one image, not all 8: what is waited for is a training step
    evaluate_on_one_image(wf)
    prompt_id = client.queue(wf)
    first = wait_first_step(client, prompt_id)
    run_dir = comfy.base_dir / "output" / "ingraph" / "runs" / first["run_id"]
    pid = int((run_dir / "trainer.pid").read_text())
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    outcome = client.follow(prompt_id, timeout=30)
    elapsed = time.monotonic() - t0
    assert outcome.status == "execution_error" and elapsed < 5.0
    message = outcome.error["exception_message"]
    assert "Training failed" in message and "exited with code -9" in message
    assert "trainer.log" in message and "--- last lines of" not in message  # named, never echoed
    assert client.get("/system_stats")["system"]

    # the same graph again: it trains instead of serving the cached failure, and is interrupted
    again = client.queue(wf)
    second = wait_first_step(client, again)
    assert second["run_id"] != first["run_id"]
    run_dir = comfy.base_dir / "output" / "ingraph" / "runs" / second["run_id"]
    pid = int((run_dir / "trainer.pid").read_text())
    t0 = time.monotonic()
    client.interrupt()
    outcome = client.follow(again, timeout=60)
    assert outcome.status == "execution_interrupted"
    wait_until(lambda: not _group_alive(pid), 3)
    elapsed = time.monotonic() - t0
    assert not _group_alive(pid), "a process of the run's group survived"
    assert elapsed < 3.0, f"took {elapsed:.2f} s"
    print(f"\ntime from POST /interrupt to no trainer process: {elapsed:.2f} s")
    assert not (comfy.base_dir / "models" / "loras" / "killed.safetensors").exists()
    assert client.get("/ingraph/runs/" + run_dir.name)["state"] in ("interrupted", "failed")


def test_run_routes_validate_ids(comfy, client):
    runs = client.get("/ingraph/runs")["runs"]
    assert runs and all({"id", "state", "step"} <= set(r) for r in runs)
    finished = next(r for r in runs if r["state"] == "finished")
    record = client.get(f"/ingraph/runs/{finished['id']}")
    assert record["artifacts"]["adapter"].endswith(".safetensors")
    events = client.get(f"/ingraph/runs/{finished['id']}/events?since=1")
    assert events["since"] == 1 and events["events"][0]["type"] != "started"
    for bad in ("nope", "..%2F..%2Fetc", "%2E%2E", "..%2Fx"):
        with pytest.raises(urllib.error.HTTPError) as info:
            client.get(f"/ingraph/runs/{bad}")
        assert info.value.code == 404


def test_pack_adds_under_half_a_second_to_startup(comfy):
    """ComfyUI times each custom node folder's import; ours must stay under 0.5 s."""
    # 0.33 prefixes each line with its level ("[INFO]", coloured: ComfyServer.log_text drops the colours)
    match = re.search(r"^(?:\[INFO\])?\s*([\d.]+) seconds: .*InGraph-Trainer-test\.v1\s*$", comfy.log_text(), re.M)
    assert match, comfy.log_text()[-3000:]
    print(f"\npack import time reported by ComfyUI: {match.group(1)} s")
    assert float(match.group(1)) < 0.5
    assert not re.search(r"IMPORT FAILED.*InGraph-Trainer", comfy.log_text())


@pytest.mark.parametrize("name", ["train_lora", "train_evaluate_compare", "distill_turbo_lora"])
def test_ui_workflow_matches_object_info(client, name):
    """Every node type of the UI-format workflow exists, and every link joins matching types; a graph with a Train
    node carries the note on its evaluation (a frontend-only Note node, which the API format has no place for)."""
    import json
    from tools.make_ui_workflow import EVALUATION_NOTE, NOTE_TYPE
    ui = json.loads((REPO / "example_workflows" / f"{name}.json").read_text())
    info = client.get("/object_info")
    notes = [n for n in ui["nodes"] if n["type"] == NOTE_TYPE]
    assert [n["widgets_values"] for n in notes] == \
        ([[EVALUATION_NOTE]] if any(n["type"] == "InGraphTrainLoRA" for n in ui["nodes"]) else [])
    nodes = {n["id"]: n for n in ui["nodes"] if n["type"] != NOTE_TYPE}
    for node in nodes.values():
        assert node["type"] in info, f"unknown node type {node['type']}"
        assert None not in node["widgets_values"], f"node {node['id']} has an unset widget"
    assert ui["links"], "the workflow has no links"
    for link_id, src, src_slot, dst, dst_slot, ltype in ui["links"]:
        out_type = info[nodes[src]["type"]]["output"][src_slot]
        target = nodes[dst]["inputs"][dst_slot]
        assert target["link"] == link_id
        spec = info[nodes[dst]["type"]]["input"]
        in_type = {**spec.get("required", {}), **spec.get("optional", {})}[target["name"]][0]
        assert out_type == in_type == ltype, (link_id, out_type, in_type, ltype)
        assert link_id in nodes[src]["outputs"][src_slot]["links"]
    api = load_workflow(f"{name}_api.json")
    assert sorted(n["type"] for n in nodes.values()) == sorted(v["class_type"] for v in api.values())
