"""Evaluation in the graph: Evaluate node, evaluation and sample previews during training, Compare grid."""
from __future__ import annotations

import copy
import io

import pytest

from conftest import load_workflow, read_events, run_trainers_forked

pytestmark = pytest.mark.comfyui

WORKFLOW = "train_evaluate_compare_api.json"
TRAIN, EVAL_TRAINED, COMPARE, SAVE_GRID = "7", "10", "11", "12"


def executed_outputs(outcome) -> dict[str, dict]:
    return {d["node"]: d["output"] for d in outcome.of_type("executed")}


@pytest.fixture(scope="module")
def workflow_run(comfy):
    """The shipped train + evaluate + compare workflow, plus a second, identical evaluation of the trained model
    (without the baseline); 20 steps, not its 40 (suite time): still evaluations at 10, 20 and previews at 20."""
    from client.api import ComfyClient
    wf = load_workflow(WORKFLOW)
    wf[TRAIN]["inputs"].update(output_name="test_evaluate_compare", steps=20)
    wf["14"] = copy.deepcopy(wf[EVAL_TRAINED])
    del wf["14"]["inputs"]["baseline"]
    client = ComfyClient(comfy.address)
    outcome = client.run(wf, timeout=600)
    client.close()
    assert outcome.ok, (outcome.status, outcome.error, comfy.log_tail())
    return outcome, wf


def events_of(outcome, kind):
    return [m["data"] for m in outcome.messages
            if m.get("type") == "ingraph.event" and m["data"]["event"]["type"] == kind]


def test_workflow_runs_headless_and_saves_the_grid(workflow_run, client):
    from PIL import Image
    outcome, wf = workflow_run
    images = executed_outputs(outcome)[SAVE_GRID]["images"]
    assert len(images) == 1
    raw = client.get(f"/view?filename={images[0]['filename']}&subfolder={images[0]['subfolder']}&type=output")
    grid = Image.open(io.BytesIO(raw))
    rows = 2 * 2  # two prompts x two seeds, columns base and trained
    width, height = wf[COMPARE]["inputs"]["width"], wf[COMPARE]["inputs"]["height"]
    assert grid.height >= rows * height and grid.width >= 2 * width
    cells = [grid.crop((180 + c * (max(width, 96) + 4), 22, 180 + c * (max(width, 96) + 4) + width, 22 + height))
             for c in range(2)]
    assert cells[0].tobytes() != cells[1].tobytes(), "base and trained images are identical"


def test_evaluate_node_adapter_beats_base_and_is_deterministic(workflow_run):
    outcome, wf = workflow_run
    out = executed_outputs(outcome)
    assert wf[EVAL_TRAINED]["inputs"]["baseline"] == wf[TRAIN]["inputs"]["model"]  # the base, as the Train node gets it
    base = out[EVAL_TRAINED]["baseline_evaluation"][0]
    trained, again = (out[n]["evaluation"][0] for n in (EVAL_TRAINED, "14"))
    assert "baseline_evaluation" not in out["14"]
    assert set(base["quantiles"]) == {"0.1", "0.3", "0.5", "0.7", "0.9"} and base["items"] == 8
    print(f"\nEvaluate: base {base['loss']:.6f}, trained {trained['loss']:.6f}")
    assert trained["loss"] < base["loss"]
    assert again == trained  # two evaluations of the same inputs: identical, to the last bit
    header, *rows = out[EVAL_TRAINED]["text"][0].splitlines()
    assert header.split() == ["quantile", "baseline", "model"] and rows[-1].split() == \
        ["mean", f"{base['loss']:.6f}", f"{trained['loss']:.6f}"]


def test_the_baseline_is_remembered_and_its_remembered_numbers_are_a_fresh_evaluations(workflow_run, comfy, client):
    """Queued again (another trained model, or here the base itself as `model`), the Evaluate node gives its
    baseline's remembered result without a trainer run, and a fresh evaluation of the same base is bit-identical."""
    outcome, wf = workflow_run
    first_base = executed_outputs(outcome)[EVAL_TRAINED]["baseline_evaluation"][0]
    graph = {k: copy.deepcopy(wf[k]) for k in ("1", "2", "3", "4")}
    graph["20"] = copy.deepcopy(wf[EVAL_TRAINED])
    graph["20"]["inputs"]["model"] = wf[EVAL_TRAINED]["inputs"]["baseline"]
    evals = comfy.dir("output", "ingraph", "evals")
    before = set(evals.iterdir())
    again = client.run(graph, timeout=300)
    assert again.ok, (again.status, again.error)
    out = executed_outputs(again)["20"]
    assert len(set(evals.iterdir()) - before) == 1  # `model` evaluated, the baseline remembered
    assert out["baseline_evaluation"][0] == first_base
    assert out["evaluation"][0] == first_base  # the fresh run: to the last bit


def test_no_evaluation_runs_before_the_first_training_step(workflow_run):
    """The shipped graph evaluates the base model through the trained model's Evaluate node (its baseline input), so
    nothing is evaluated between the queue and the first step: a separate Evaluate node on the base could run first
    (ComfyUI runs ready output nodes in the order its set of outputs happens to iterate in). The guard is the graph's
    shape (every Evaluate node of the shipped graph downstream of the Train node); the order this run took is
    checked too, as what that shape gives."""
    outcome, wf = workflow_run
    shipped = load_workflow(WORKFLOW)

    def upstream(node: str) -> set[str]:
        found = set()
        for value in shipped[node]["inputs"].values():
            if isinstance(value, list) and len(value) == 2 and value[0] not in found:
                found |= {value[0]} | upstream(value[0])
        return found
    evaluate_nodes = [n for n, v in shipped.items() if v["class_type"] == "InGraphEvaluate"]
    assert evaluate_nodes and all(TRAIN in upstream(n) for n in evaluate_nodes), evaluate_nodes
    order = [m["data"]["node"] for m in outcome.messages
             if m.get("type") == "executing" and m["data"].get("node") is not None]
    assert TRAIN in order and EVAL_TRAINED in order
    assert not [n for n in order[:order.index(TRAIN)] if wf[n]["class_type"] == "InGraphEvaluate"]


def test_training_evaluates_and_previews_at_the_configured_steps(workflow_run, comfy, client):
    outcome, wf = workflow_run
    inputs = wf[TRAIN]["inputs"]
    steps, every = inputs["steps"], inputs["eval_every"]
    evals = [d["event"] for d in events_of(outcome, "eval") if d["node"] == TRAIN]
    # before the first step only when asked (eval_before): the Evaluate node's baseline input gives that baseline
    assert [e["step"] for e in evals] == list(range(0 if inputs.get("eval_before") else every, steps + 1, every))
    assert all(e["items"] == min(inputs.get("eval_items", 8), 8) for e in evals)  # 8 example images
    samples = [d for d in events_of(outcome, "sample") if d["node"] == TRAIN]
    sample_every = wf["6"]["inputs"]["every"]
    assert [d["event"]["step"] for d in samples] == list(range(sample_every, steps + 1, sample_every))
    run_id = samples[0]["run_id"]
    record = client.get(f"/ingraph/runs/{run_id}")
    best = min(evals, key=lambda e: e["loss"])
    assert record["best_eval"] == {"step": best["step"], "loss": best["loss"]}
    prompts = wf["6"]["inputs"]["prompts"].splitlines()
    for d in samples:
        assert len(d["event"]["images"]) == len(prompts)
        for path in d["event"]["images"]:
            png = client.get(f"/ingraph/runs/{run_id}/{path}")
            assert png[:8] == b"\x89PNG\r\n\x1a\n", path
    assert record["artifacts"]["samples"] == [p for d in samples for p in d["event"]["images"]]
    tensorboard = list((comfy.dir("output", "ingraph", "runs", run_id, "tensorboard")).glob("events.out.*"))
    assert tensorboard


def test_sample_route_refuses_other_files(workflow_run, client):
    import urllib.error
    outcome, _ = workflow_run
    run_id = events_of(outcome, "sample")[0]["run_id"]
    for path in ("samples/..%2Frun.toml", "samples/.hidden.png", "samples/missing.png", "run.toml"):
        with pytest.raises(urllib.error.HTTPError) as err:
            client.get(f"/ingraph/runs/{run_id}/{path}")
        assert err.value.code == 404, path


def test_previews_do_not_change_training(prepared):
    """Sampling uses the global RNG; it is forked, so a run with previews trains exactly as one without."""
    common = dict(train__steps=4, train__eval_every=2, train__precision="fp32", adapter__dropout=0.1,
                  train__eval_quantiles=[0.5])
    with_previews = prepared(**common, samples__every=3, samples__steps=2, samples__width=64, samples__height=64,
                             samples__prompts=["a red circle", "a blue square"])
    from ingraph_trainer.trainer.spec import dump_run_spec, load_run_spec
    spec = load_run_spec(with_previews)
    plain = with_previews.parent.with_name(with_previews.parent.name + "-plain")
    plain.mkdir()
    spec.run_dir, spec.output.lora_path, spec.samples.every = str(plain), str(plain / "lora.safetensors"), 0
    (plain / "run.toml").write_text(dump_run_spec(spec))
    proc = run_trainers_forked(with_previews, plain / "run.toml")  # each its own process, the imports shared
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_events(with_previews.parent), read_events(plain)
    assert [e["step"] for e in a if e["type"] == "sample"] == [3, 4]
    assert not (plain / "samples").exists()
    for kind in ("step", "eval"):
        assert [e["loss"] for e in a if e["type"] == kind] == [e["loss"] for e in b if e["type"] == kind]
    assert sorted(p.name for p in (with_previews.parent / "samples").iterdir()) == \
        ["step000003_0.png", "step000003_1.png", "step000004_0.png", "step000004_1.png"]


def test_evaluation_off_gives_no_eval_points_and_a_whole_result(prepared):
    """eval_items 0, or no quantiles: no evaluation at all, and the run's result and events are well formed."""
    common = dict(train__steps=2, train__precision="fp32", train__eval_every=1, train__eval_before=True)
    specs = [prepared(**common, train__eval_items=0), prepared(**common, train__eval_quantiles=[])]
    proc = run_trainers_forked(*specs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for spec in specs:
        events = read_events(spec.parent)
        assert [e["type"] for e in events if e["type"] in ("started", "step", "finished")] == \
            ["started", "step", "step", "finished"]
        assert not [e for e in events if e["type"] == "eval"]
        started, finished = events[0], events[-1]
        assert started["eval_items"] == 0
        assert finished["eval_before"] is finished["eval_after"] is finished["best_eval_step"] is None
        assert (spec.parent / "lora.safetensors").is_file()


def test_a_fixed_subset_is_evaluated_the_same_on_a_resume(prepared):
    """eval_items of the 8 images, drawn with the seed: every evaluation of the run, and of its resume, measures the
    same items with the same noise (the losses agree to the bit at every evaluated step)."""
    from conftest import run_trainer
    common = dict(train__steps=4, train__precision="fp32", train__eval_every=2, train__save_every=2,
                  train__eval_items=3, train__eval_quantiles=[0.5], train__seed=5)
    whole = prepared(**common)
    assert run_trainer(whole).returncode == 0
    evals = {e["step"]: e for e in read_events(whole.parent) if e["type"] == "eval"}
    assert sorted(evals) == [2, 4] and all(e["items"] == 3 for e in evals.values())
    assert read_events(whole.parent)[0]["eval_items"] == 3
    resumed = prepared(**common)
    assert run_trainer(resumed, kill_on="checkpoint").returncode != 0
    assert run_trainer(resumed, "--resume", "latest").returncode == 0
    again = {e["step"]: e["loss"] for e in read_events(resumed.parent) if e["type"] == "eval"}
    assert again == {step: e["loss"] for step, e in evals.items()}
    everything = prepared(**dict(common, train__eval_items=8))  # all 8: another figure, so the subset is a subset
    assert run_trainer(everything).returncode == 0
    assert [e["loss"] for e in read_events(everything.parent) if e["type"] == "eval"][-1] != evals[4]["loss"]
    # the Evaluate node's task, same seed and item count, on the trained LoRA: the same items, the same figure
    lora = read_events(whole.parent)[-1]["adapter"]
    evaluate = prepared(task="evaluate", output__lora_path="", train__precision="fp32", train__seed=5,
                        train__eval_items=3, train__eval_quantiles=[0.5], model__lora_paths=[lora],
                        model__lora_strengths=[1.0], model__stamps=[])
    assert run_trainer(evaluate).returncode == 0
    result = read_events(evaluate.parent)[-1]["evaluation"]
    assert result["items"] == 3 and result["loss"] == pytest.approx(evals[4]["loss"], rel=1e-6)
