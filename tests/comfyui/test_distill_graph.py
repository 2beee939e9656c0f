"""Distillation in the graph (issue 16): the Distill node, its runner (runner/distill_run.py), the live panel's
fake-score series, and the shipped workflow run through a real ComfyUI server, whose student loads in stock
ComfyUI and samples in 1 step.

Unit tests need no server and launch no trainer; the graph test is one distillation, stopped, resumed and cancelled."""
from __future__ import annotations

import copy
import json
import re
import os
import tomllib
import types
from pathlib import Path

import pytest

from conftest import load_workflow, wait_first_step
from waiting import wait_until
from panel_script import run_panel_script

from ingraph_trainer.runner import distill_run, runs
from ingraph_trainer.trainer.run import checkpoint as ckpt
from ingraph_trainer.trainer import spec as config
from ingraph_trainer.trainer.graph_model import GraphModel
from ingraph_trainer.trainer.run import trust

WORKFLOW = "distill_turbo_lora_api.json"
DISTILL = "6"  # the Distill node of the shipped workflow
SAMPLE = "12"  # its SaveImage of the student's sample


def _node_class():
    from tools.bootstrap import bootstrap
    bootstrap()
    from ingraph_trainer.nodes.distill_node import Distill
    return Distill


# --- the node and its checks (no server, no trainer) -----------------------------------------------------------

@pytest.mark.comfyui
def test_the_node_is_registered_with_a_tooltip_on_every_input_and_the_spec_defaults():
    Distill = _node_class()
    from ingraph_trainer.nodes import NODES
    assert Distill in NODES
    schema = Distill.define_schema()
    inputs = {i.id: i for i in schema.inputs}
    assert all(i.tooltip and len(i.tooltip) > 20 for i in schema.inputs), [i.id for i in schema.inputs if not i.tooltip]
    defaults = config.DistillSpec()
    for name in ("student_steps", "guidance_scale", "fake_learning_rate", "fake_updates", "dmd_weight",
                 "denoising_weight", "gan_weight", "regression_steps", "backward_simulation", "fake_score_per_step",
                 "min_t", "max_t"):
        assert inputs[name].default == getattr(defaults, name), name
    assert (inputs["student_steps"].min, inputs["student_steps"].max) == (1, 4)
    assert inputs["precision"].options == config.choice_labels(config.PRECISION_CHOICES)
    names = [i.id for i in schema.inputs]
    first_optional = next(n for n, i in enumerate(schema.inputs) if i.optional)
    assert all(i.optional for i in schema.inputs[first_optional:]) and names[first_optional] == "resume"
    assert [o.display_name for o in schema.outputs] == ["model", "student_name"]
    # the prompt is refused at queue time for a bad output name or timesteps that do not fit the step count
    assert Distill.validate_inputs("turbo", 2, "1.0, 0.5") is True
    assert "student_timesteps" in Distill.validate_inputs("turbo", 2, "1.0")
    assert "output_name" in Distill.validate_inputs("bad:name", 1)


def test_the_student_must_be_a_lora_or_a_full_fine_tune_not_continued_from_an_adapter_file(tmp_path):
    """The spec's rule (DistillSpec.problems), so a hand-written distill spec is refused the same: the trainer reads
    no adapter file for the student, which starts as the teacher's copy."""
    def problems(adapter):
        return [p for p in config.RunSpec(task="distill", adapter=adapter).problems() if p.startswith("adapter.")]
    for kind, label in (("loha", "LoHa"), ("lokr", "LoKr"), ("dora", "DoRA")):
        assert problems(config.AdapterSpec(kind=kind)) == [
            f"adapter.kind: the student trains as LoRA or Full fine-tune (got {label})"]
    for kind in config.DISTILL_STUDENT_KINDS:
        assert problems(config.AdapterSpec(kind=kind)) == []
    (tmp_path / "turbo.safetensors").write_bytes(b"")
    [refused] = problems(config.AdapterSpec(kind="lora", init_from=str(tmp_path / "turbo.safetensors")))
    assert refused.startswith("adapter.init_from: the student starts as a copy of the teacher, not from an adapter "
                              "file (the LoRA Adapter node's continue_from")


@pytest.mark.comfyui
def test_settings_the_spec_refuses_are_refused_naming_the_node_input(monkeypatch):
    """The spec's own rules, asked of the node's draft before the teacher is handed off (runner.node_run), each
    naming the Distill node's input (a layout's field, from the DeepSpeed Settings node, keeps its dotted name);
    the teacher's guidance against the dataset's cache too."""
    Distill = _node_class()
    from ingraph_trainer.runner import model_source, node_run, session

    def hand_off(*args, **kwargs):
        raise AssertionError("a refused run was handed off")
    monkeypatch.setattr(model_source, "hand_off_model", hand_off)
    monkeypatch.setattr(model_source, "release_comfy_models", lambda model: None)
    monkeypatch.setattr(GraphModel, "prediction", "epsilon")
    monkeypatch.setattr(distill_run, "check_family_settings", lambda *a, **k: None)
    monkeypatch.setattr(distill_run, "check_dataset_for_model", lambda *a, **k: None)
    monkeypatch.setattr(Distill, "hidden", types.SimpleNamespace(unique_id="6", prompt=None), raising=False)
    cached = types.SimpleNamespace(empty_text=("key", "sha"), require_cached=lambda name: None)

    def refused(dataset=cached, adapter=config.AdapterSpec(), **inputs):
        with pytest.raises(ValueError) as info:
            Distill.execute(object(), dataset, adapter, output_name="refused_probe", **inputs)
        return str(info.value)
    assert refused(fake_updates=0).startswith("Distill: fake_updates: must be at least 1")
    assert refused(adapter=config.AdapterSpec(kind="lokr")) == (  # the LoRA Adapter node's field keeps its name
        "Distill: adapter.kind: the student trains as LoRA or Full fine-tune (got LoKr)")
    assert refused(min_t=0.9, max_t=0.5).startswith("Distill: min_t: needs 0 <= min_t < max_t")
    assert refused(fake_score_per_step=True, gan_weight=0.1).startswith(
        "Distill: fake_score_per_step: the GAN term is not yet kept with a fake score per student step")
    assert refused(gradient_accumulation=0).startswith("Distill: gradient_accumulation: ")  # a renamed field
    assert "distributed.pipeline_stages" in refused(distributed=config.DistributedSpec(processes=2,
                                                                                        pipeline_stages=2))
    assert refused(distributed=config.DistributedSpec(block_swap=2)).startswith("Distill: distributed.block_swap: ")
    assert re.match(r"^Distill: guidance_scale: .* queue Cache Text Embeddings again",
                    refused(types.SimpleNamespace(empty_text=(), require_cached=lambda name: None), guidance_scale=1.5))
    for kind in config.DISTILL_STUDENT_KINDS:  # nothing of the spec's refuses a default distillation
        assert node_run.settings_problems(config.RunSpec(task="distill", adapter=config.AdapterSpec(kind=kind)),
                                          session.RunDatasets(cached)) == []
    parse = distill_run.parse_student_timesteps
    assert parse("", 4) == [] and parse(" 1.0, 0.75 0.5,0.25 ", 4) == [1.0, 0.75, 0.5, 0.25]
    for text, steps in (("1.0 0.5", 1), ("0.5 1.0", 2), ("1.5", 1), ("0", 1), ("fast", 1)):
        with pytest.raises(ValueError, match=r"^Distill: student_timesteps: "):
            parse(text, steps)


@pytest.mark.comfyui
def test_the_runner_writes_a_distill_spec_through_the_train_nodes_run(monkeypatch, tmp_path):
    """The Distill node's draft reaches prepare_run with task "distill" and its [distill] table through the Train
    node's run (runner.node_run.run_task); a refused adapter stops it before anything is handed off."""
    Distill = _node_class()  # ComfyUI importable (the output path is ComfyUI's models/loras)
    from ingraph_trainer.runner import model_source, node_run, session

    class Handed(Exception):
        pass

    def prepare_run(draft, **kwargs):
        raise Handed(draft)
    handed_off = []
    monkeypatch.setattr(model_source, "hand_off_model", lambda *a, **k: handed_off.append(a) or types.SimpleNamespace(
        model_spec=config.ModelSpec(path="teacher.safetensors"), source=None))
    monkeypatch.setattr(model_source, "release_comfy_models", lambda model: None)
    monkeypatch.setattr(GraphModel, "prediction", "epsilon")
    monkeypatch.setattr(distill_run, "check_family_settings", lambda *a, **k: None)
    monkeypatch.setattr(distill_run, "check_dataset_for_model", lambda *a, **k: None)
    monkeypatch.setattr(session, "prepare_run", prepare_run)
    monkeypatch.setattr(node_run, "refuse_foreign_file", lambda *a, **k: None)
    distill = config.DistillSpec(student_steps=2, student_timesteps=[1.0, 0.5], fake_updates=3, gan_weight=0.01)
    # the node's inputs as a saved workflow gives them: the ones not given take the schema's defaults
    inputs = dict(steps=7, student_steps=2, student_timesteps="1.0, 0.5", fake_updates=3, gan_weight=0.01,
                  output_name="distill_probe")
    dataset = types.SimpleNamespace(empty_text=("key", "sha"), require_cached=lambda name: None)  # guidance may be used
    monkeypatch.setattr(Distill, "hidden", types.SimpleNamespace(unique_id="6", prompt=None), raising=False)
    with pytest.raises(Handed) as info:
        Distill.execute(object(), dataset, config.AdapterSpec(kind="lora"), **inputs)
    spec = info.value.args[0]
    assert spec.task == "distill" and spec.output.format == "comfyui" and spec.train.steps == 7
    spec.run_dir, spec.output.lora_path, spec.data.manifest = str(tmp_path), "student.safetensors", "dataset.json"
    spec.validate()
    written = config.spec_from_dict(tomllib.loads(config.dump_run_spec(spec)), "written")
    assert written.task == "distill" and written.distill == distill and written.distill is not distill

    handed_off.clear()
    with pytest.raises(ValueError, match=r"Distill: adapter.kind: .* \(got DoRA\)"):
        Distill.execute(object(), dataset, config.AdapterSpec(kind="dora"), **inputs)
    assert not handed_off


def test_a_node_after_distill_gets_the_teacher_and_the_turbo_lora_as_files(tmp_path):
    """The Distill node's output MODEL is recorded as its source plus the student (as the Train node's is), so an
    Evaluate or Train node after it hands the trainer files instead of materialising the weights."""
    from ingraph_trainer.runner import model_source as ms
    teacher, student = tmp_path / "teacher.safetensors", tmp_path / "turbo.safetensors"
    teacher.write_bytes(b"t" * 16)
    student.write_bytes(b"s" * 16)
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "teacher.safetensors"}},
              "6": {"class_type": "InGraphDistill", "inputs": {"model": ["1", 0]}},
              "7": {"class_type": "InGraphEvaluate", "inputs": {"model": ["6", 0]}}}

    def resolve(folder, name):
        return str(teacher) if (folder, name) == ("checkpoints", teacher.name) else None
    base = ms.describe_model(prompt, ["1", 0], None, resolve)
    distilled = GraphModel(types.SimpleNamespace(patches={"k": [1]}, patches_uuid="student-patches"))
    ms.record_trained_output("6", distilled, ms.trained_output_source(str(student), base, full=False,
                                                                      file_format="comfyui"))
    try:
        source = ms.describe_model(prompt, ms.input_link(prompt, "7", "model"), distilled, resolve)
        assert (source.path, source.format, source.loras) == (str(teacher), "checkpoint", ((str(student), 1.0),))
    finally:
        ms.record_trained_output("6", distilled, None)


class _Engine:
    def save_checkpoint(self, root, tag, client_state, save_latest, exclude_frozen_parameters):
        (Path(root) / tag).mkdir(parents=True)
        (Path(root) / tag / "state.json").write_text(json.dumps(client_state["trainer"]))


def _signed_run(root: Path, run_id: str, task: str | None) -> Path:
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "run.toml").write_text((f'task = "{task}"\n' if task else "") + '[output]\nname = "turbo"\n')
    (run_dir / "dataset.json").write_text("{}")
    ckpt.save_checkpoint(_Engine(), run_dir, 2, {"step": 2, "seed": 0}, True, keep_last=0)
    trust.sign_run(run_dir, ["run.toml", "dataset.json"])
    return run_dir


def test_resume_continues_only_a_run_of_the_same_task(tmp_path, monkeypatch):
    monkeypatch.setenv(trust.SECRET_ENV, str(tmp_path / "secret"))
    root = tmp_path / "runs"
    distilled = _signed_run(root, "20260101-000000-turbo-aaaa", "distill")
    trained = _signed_run(root, "20260102-000000-turbo-bbbb", None)  # newer; a spec without a task trains
    assert runs.resolve_resume_choice(root, "latest", "turbo", "distill") == (distilled, "step_000002")
    assert runs.resolve_resume_choice(root, "latest", "turbo", "train") == (trained, "step_000002")
    assert runs.resolve_resume_choice(root, "latest", "turbo") == (trained, "step_000002")  # no task: any run
    with pytest.raises(ValueError, match=rf"run '{trained.name}' is a train run, not a distill run"):
        runs.resolve_resume_choice(root, f"{trained.name}/step_000002", "turbo", "distill")
    assert runs.resolve_resume_choice(root, f"{distilled.name}/step_000002", "turbo", "distill") \
        == (distilled, "step_000002")
    # what each node offers: its own task's checkpoints
    assert runs.resumable_checkpoints(root, task="distill") == [f"{distilled.name}/step_000002"]
    assert runs.resumable_checkpoints(root, task="train") == [f"{trained.name}/step_000002"]
    assert len(runs.resumable_checkpoints(root)) == 2


# --- the live panel under node: a distillation's fake-score loss is a second series ----------------------------

PANEL_DRIVER = r"""
const calls = { lineTo: 0, strokeStyles: [] };
const ctx = new Proxy({}, { get: (t, k) => (k === "lineTo" ? () => calls.lineTo++ : () => {}),
                            set: (t, k, v) => { if (k === "strokeStyle") calls.strokeStyles.push(v); return true; } });
function element() {
  const el = { style: {}, dataset: {}, textContent: "", children: [], clientWidth: 400, clientHeight: 120, roles: {},
    addEventListener() {}, querySelector: (sel) => (el.roles[sel] ??= element()), getContext: () => ctx,
    prepend(c) { el.children.unshift(c); } };
  return el;
}
globalThis.document = { createElement: element };
globalThis.window = { devicePixelRatio: 1 };
const { Panel } = await import("./ext/pack/ingraph_trainer.js");
const { registered } = await import("./scripts/app.js");
const panelFor = {};
for (const name of ["InGraphTrainLoRA", "InGraphDistill", "InGraphEvaluate"]) {
  const nodeType = { prototype: {} };
  await registered[0].beforeRegisterNodeDef(nodeType, { name });
  panelFor[name] = typeof nodeType.prototype.onNodeCreated === "function";
}
function run(events) {
  const panel = new Panel({ id: 1 });
  panel.replaying = true;
  panel.apply("run", { type: "started", total: 3, start_step: 0 });
  events.forEach((e) => panel.apply("run", e));
  panel.replaying = false;
  calls.strokeStyles = [];
  panel.render();
  return { fake: Number(panel.$("chart").dataset.fake), points: Number(panel.$("chart").dataset.points),
           fakeText: panel.$("fake").textContent, fakeShown: panel.$("fake-stat").style.display !== "none",
           colours: calls.strokeStyles.length };
}
const step = (s, extra) => ({ type: "step", step: s, total: 3, loss: 1 / s, lr: 1e-4, samples_per_s: 2, eta_s: 3 - s,
                              ...extra });
const distill = run([1, 2, 3].map((s) => step(s, { generator_loss: 1 / s, dmd_loss: 1 / s, fake_loss: 0.25 * s })));
const train = run([1, 2, 3].map((s) => step(s)));
console.log(JSON.stringify({ panelFor, distill, train }));
"""


def test_the_panel_follows_the_distill_node_and_draws_the_fake_score_loss(tmp_path):
    result = run_panel_script(tmp_path, PANEL_DRIVER)
    assert result["panelFor"] == {"InGraphTrainLoRA": True, "InGraphDistill": True, "InGraphEvaluate": False}
    distill, train = result["distill"], result["train"]
    assert distill["fake"] == 3 and distill["points"] == 3 and distill["fakeShown"] and distill["fakeText"] == "0.7500"
    assert distill["colours"] == train["colours"] + 1  # one more line: the fake score's
    assert train["fake"] == 0 and not train["fakeShown"]


# --- through a real ComfyUI server ------------------------------------------------------------------------------

def stock_sampling_graph(lora_name: str | None, prefix: str, steps: int = 1, loader: str = "LoraLoaderModelOnly"):
    """Load Checkpoint (+ the stock LoRA loader) -> KSampler as the shipped workflow samples the student -> Save."""
    wf = load_workflow(WORKFLOW)
    graph = {k: copy.deepcopy(wf[k]) for k in ("1", "7", "8", "9", "10", "11", "12")}
    graph["10"]["inputs"].update(steps=steps, model=["1", 0])
    graph["12"]["inputs"]["filename_prefix"] = prefix
    if lora_name:
        inputs = {"model": ["1", 0], "lora_name": lora_name, "strength_model": 1.0}
        if loader == "LoraLoader":  # the text encoder as loaded: the file holds diffusion-model keys only
            inputs.update(clip=["1", 1], strength_clip=1.0)
        graph["20"] = {"class_type": loader, "inputs": inputs}
        graph["10"]["inputs"]["model"] = ["20", 0]
    return graph


def _saved_image(comfy, prefix: str):
    import numpy as np
    from PIL import Image
    saved = sorted((comfy.base_dir / "output").glob(f"{prefix}_*.png"))
    assert saved, f"no image saved with prefix {prefix}"
    return np.asarray(Image.open(saved[-1]), dtype=np.int16)


def _distill_events(outcome) -> list[dict]:
    return [m["data"] for m in outcome.messages if m.get("type") == "ingraph.event"]


def _assert_losses(event: dict):
    for key in ("loss", "generator_loss", "dmd_loss", "fake_loss"):
        assert isinstance(event.get(key), (int, float)), (key, event)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _run_until_stopped(client, wf: dict) -> tuple[dict, list[dict], list[dict]]:
    """Queues the workflow, stops its run after the first update it reports, follows the prompt to its end:
    (the first step's ingraph.event data; the Distill node's events after it; the node's progress messages)."""
    prompt_id = client.queue(wf)
    first = wait_first_step(client, prompt_id)
    assert client.post(f"/ingraph/runs/{first['run_id']}/stop")["stop_requested"] is True
    outcome = client.follow(prompt_id, timeout=300)
    assert outcome.ok, (outcome.status, outcome.error)
    messages = _distill_events(outcome)
    assert first["node"] == DISTILL and {m["node"] for m in messages} == {DISTILL}
    assert {m["run_id"] for m in messages} == {first["run_id"]}
    assert SAMPLE in {d["node"] for d in outcome.of_type("executed")}  # the KSampler on the node's MODEL ran
    # ComfyUI's progress state of the node as later nodes start (its progress messages came before the first step)
    states = [d["nodes"][DISTILL] for d in outcome.of_type("progress_state") if DISTILL in d.get("nodes", {})]
    return first, [m["event"] for m in messages], states


@pytest.mark.comfyui
def test_the_distill_workflow_runs_from_the_graph_and_its_student_samples_in_one_step_in_stock_comfyui(comfy,
                                                                                                      client):
    """The shipped workflow distilling a 1-step student (with a preview after every update), stopped from the
    panel's route after its first update, resumed from the node (resume = latest), then cancelled: events from the
    Distill node carry the generator and fake-score losses; the spec is a distillation's; the resumed run
    continues the same run from the stop's checkpoint; Cancel ends its trainer within 10 s; the turbo LoRA
    (ComfyUI keys) loads in stock LoraLoaderModelOnly and Load LoRA with no "lora key not loaded", changes the
    1-step image, and gives the image that the Distill node's own MODEL output gave."""
    wf = load_workflow(WORKFLOW)
    total = 1000  # ended by Stop, then by Cancel
    # fp32: bf16 convolutions are slow on CPU and precision is not the point; one fake update keeps it cheap
    wf[DISTILL]["inputs"].update(steps=total, batch_size=1, student_steps=1, fake_updates=1, precision="fp32",
                                 save_every=0, output_name="test_turbo")
    wf["10"]["inputs"]["steps"] = 1
    wf[SAMPLE]["inputs"]["filename_prefix"] = "distill_output_model"
    # previews: the student rendered by the trainer in its own step count (1 step at 64 px: cheap)
    wf["30"] = {"class_type": "InGraphSamplePreviews",
                "inputs": {"clip": ["1", 1], "vae": ["1", 2], "prompts": "a red circle, ingraph style",
                           "negative_prompt": "", "every": 1, "steps": 20, "cfg": 7.0, "sampler_name": "euler",
                           "scheduler": "normal", "seed": 0, "width": 64, "height": 64}}
    wf[DISTILL]["inputs"]["previews"] = ["30", 0]

    first, events, progress = _run_until_stopped(client, wf)
    run_id = first["run_id"]
    assert first["event"]["step"] == 1
    _assert_losses(first["event"])
    finished = [e for e in events if e["type"] == "finished"][-1]
    stopped_at = finished["steps"]
    assert finished["stopped"] is True and 1 <= stopped_at < total
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == list(range(2, stopped_at + 1))
    for event in steps:
        _assert_losses(event)
    assert [e for e in events if e["type"] == "checkpoint"][-1]["step"] == stopped_at
    assert progress and all(p["max"] == total for p in progress), progress[-1:]  # the bar counts generator updates
    run_dir = comfy.base_dir / "output" / "ingraph" / "runs" / run_id
    samples = [e for e in events if e["type"] == "sample"]
    assert samples[-1]["step"] == stopped_at and (run_dir / samples[-1]["images"][0]).is_file()
    spec = tomllib.loads((run_dir / "run.toml").read_text())
    assert spec["task"] == "distill" and spec["adapter"]["kind"] == "lora" and spec["train"]["steps"] == total
    assert spec["distill"]["student_steps"] == 1 and spec["distill"]["fake_updates"] == 1

    lora = comfy.base_dir / "models" / "loras" / "test_turbo.safetensors"
    written = lora.read_bytes()  # the student as the stop left it

    # resume = latest continues this run (a distillation of this output name) from the stop's checkpoint; Cancel
    # (ComfyUI's interrupt) ends it and its trainer at once, writing nothing
    wf[DISTILL]["inputs"]["resume"] = "latest"
    prompt_id = client.queue(wf)
    again = wait_first_step(client, prompt_id)
    assert again["node"] == DISTILL and again["run_id"] == run_id and again["event"]["step"] == stopped_at + 1
    pid = int((run_dir / "trainer.pid").read_text())
    client.interrupt()
    assert client.follow(prompt_id, timeout=60).status == "execution_interrupted"
    assert wait_until(lambda: not _alive(pid), 10, every=0.1), "the cancelled run's trainer is still running"
    assert lora.read_bytes() == written

    from safetensors.torch import load_file
    keys = set(load_file(lora))
    assert keys and all(k.startswith("diffusion_model.") and k.endswith((".lora_down.weight", ".lora_up.weight",
                                                                         ".alpha")) for k in keys)

    stock = {**stock_sampling_graph("test_turbo.safetensors", "distill_stock_lora"),
             **_renamed(stock_sampling_graph("test_turbo.safetensors", "distill_lora_loader", loader="LoraLoader"),
                        "l"),
             **_renamed(stock_sampling_graph(None, "distill_teacher"), "t")}
    outcome = client.run(stock, timeout=300)
    assert outcome.ok, (outcome.status, outcome.error)
    assert "lora key not loaded" not in comfy.log_text()
    student, teacher = _saved_image(comfy, "distill_stock_lora"), _saved_image(comfy, "distill_teacher")
    assert abs(student - teacher).max() > 0  # the LoRA changes the 1-step image
    assert abs(student - _saved_image(comfy, "distill_lora_loader")).max() <= 1  # Load LoRA applies it alike
    # the stopped run's output MODEL (the cancelled one saved no image) is the teacher with this LoRA
    assert abs(student - _saved_image(comfy, "distill_output_model")).max() <= 1


def _renamed(graph: dict, prefix: str) -> dict:
    """The graph with its node ids prefixed (links too), to put two graphs into one prompt."""
    out = {}
    for key, node in graph.items():
        node = copy.deepcopy(node)
        for name, value in node["inputs"].items():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                node["inputs"][name] = [prefix + value[0], value[1]]
        out[prefix + key] = node
    return out
