"""The graph's MODEL reaches the trainer as files (no copies), the fallback says which node forced a copy, and
ComfyUI gives the device up before the trainer starts (runner/model_source.py, runner/train_run.py)."""
from __future__ import annotations

import copy
import json
import os
import re
import time
import tomllib
from pathlib import Path

import pytest

from conftest import evaluate_on_one_image, load_workflow, write_upstream_lora

from ingraph_trainer.runner import model_source as ms
from ingraph_trainer.runner import materialise
from ingraph_trainer.trainer.graph_model import GraphModel


# --- the walk over API prompts (no server) ---------------------------------------------------------------------

@pytest.fixture
def files(tmp_path):
    """Fake model files by folder, and the resolver the walk uses instead of ComfyUI's folder_paths."""
    made = {}
    for folder, name in [("checkpoints", "base.safetensors"), ("diffusion_models", "unet.safetensors"),
                         ("loras", "style.safetensors"), ("loras", "detail.safetensors"), ("loras", "old.ckpt"),
                         ("vae", "kl.safetensors")]:
        path = tmp_path / folder / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(64))
        made[(folder, name)] = str(path)
    return made, lambda folder, name: made.get((folder, name))


def ckpt_lora_train(strength=0.7) -> dict:
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "base.safetensors"}},
        "2": {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1],
                                                     "lora_name": "style.safetensors", "strength_model": strength,
                                                     "strength_clip": 1.0}},
        "3": {"class_type": "ModelSamplingDiscrete", "inputs": {"model": ["2", 0], "sampling": "v_prediction",
                                                                "zsnr": False}},
        "4": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["3", 0], "lora_name": "detail.safetensors",
                                                              "strength_model": -0.5}},
        "9": {"class_type": "InGraphTrainLoRA", "inputs": {"model": ["4", 0]}},
    }


class FakePatcher:
    """What the walk reads of a live ModelPatcher: its weight patches and their identity."""

    def __init__(self, patches=None, uuid=None):
        self.patches, self.patches_uuid = patches or {}, uuid


def FakeModel(patches=None, uuid=None) -> GraphModel:  # noqa: N802 - stands where a class stood
    """A live MODEL as the runner holds it (the trainer-side view of FakePatcher)."""
    return GraphModel(FakePatcher(patches, uuid))


def test_checkpoint_then_loras_in_graph_order_with_their_strengths(files):
    made, resolve = files
    prompt = ckpt_lora_train()
    # no live model: the fake LoRA files hold no tensors to compare (that check has its own test below)
    source = ms.describe_model(prompt, ms.input_link(prompt, "9", "model"), None, resolve)
    assert source.path == made[("checkpoints", "base.safetensors")] and source.format == "checkpoint"
    assert source.loras == ((made[("loras", "style.safetensors")], 0.7), (made[("loras", "detail.safetensors")], -0.5))
    spec = source.model_spec("v_prediction")
    assert spec.lora_paths == [p for p, _ in source.loras] and spec.lora_strengths == [0.7, -0.5]
    st = os.stat(source.path)
    assert spec.stamps[0] == f"{st.st_size}:{st.st_mtime_ns}" and len(spec.stamps) == 3
    assert spec.format == "checkpoint" and spec.prediction == "v_prediction"


def test_unet_loader_keeps_its_weight_dtype_and_zero_strength_loras_are_no_patch(files):
    made, resolve = files
    prompt = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "unet.safetensors",
                                                           "weight_dtype": "fp8_e4m3fn"}},
              "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "strength_model": 0.0,
                                                                    "lora_name": "style.safetensors"}}}
    source = ms.describe_model(prompt, ["2", 0], FakeModel(), resolve)
    assert (source.path, source.format, source.weight_dtype, source.loras) == \
        (made[("diffusion_models", "unet.safetensors")], "diffusion_model", "fp8_e4m3fn", ())


@pytest.mark.parametrize("change,culprit", [
    (lambda p: p.update({"5": {"class_type": "ModelMergeSimple", "inputs": {"model1": ["1", 0], "model2": ["1", 0],
                                                                           "ratio": 0.5}}})
     or p["2"]["inputs"].update(model=["5", 0]), r"node 5 \(ModelMergeSimple\)"),
    (lambda p: p["2"]["inputs"].update(strength_model=["7", 0]), r"node 2 \(LoraLoader\): strength_model is not"),
    (lambda p: p["4"]["inputs"].update(lora_name="old.ckpt"), r"node 4 \(LoraLoaderModelOnly\): 'old.ckpt' is not a "
                                                             r"\.safetensors file"),
    (lambda p: p["1"]["inputs"].update(ckpt_name="gone.safetensors"), r"node 1 \(CheckpointLoaderSimple\): "
                                                                      r"'gone.safetensors' is not a file"),
    (lambda p: p["9"]["inputs"].update(model=["1", 1]), r"node 1 \(CheckpointLoaderSimple\): output 1"),
])
def test_what_cannot_be_described_names_the_node(files, change, culprit):
    _, resolve = files
    prompt = ckpt_lora_train()
    change(prompt)
    with pytest.raises(ms.Undescribable, match=culprit):
        ms.describe_model(prompt, prompt["9"]["inputs"]["model"], FakeModel({"k": [1]}), resolve)


def test_a_prompt_that_disagrees_with_the_live_model_is_not_trusted(files):
    _, resolve = files
    prompt = ckpt_lora_train()
    with pytest.raises(ms.Undescribable, match="patches differ"):  # LoRAs described, none on the live model
        ms.describe_model(prompt, ["4", 0], FakeModel(), resolve)
    with pytest.raises(ms.Undescribable, match="patches differ"):  # no LoRA described, patches on the live model
        ms.describe_model(prompt, ["1", 0], FakeModel({"k": [1]}), resolve)


def test_train_output_is_its_source_plus_the_new_adapter_while_it_is_the_live_object(files, tmp_path):
    made, resolve = files
    adapter = tmp_path / "loras" / "trained.safetensors"
    adapter.write_bytes(b"x" * 10)
    prompt = ckpt_lora_train()
    base = ms.describe_model(prompt, ["4", 0], None, resolve)
    trained = FakeModel({"k": [1]}, uuid="patches-of-the-trained-model")
    ms.record_trained_output("9", trained, ms.trained_output_source(str(adapter), base, full=False,
                                                                    file_format="comfyui"))
    prompt["10"] = {"class_type": "ModelSamplingDiscrete", "inputs": {"model": ["9", 0]}}
    prompt["11"] = {"class_type": "InGraphEvaluate", "inputs": {"model": ["10", 0]}}
    source = ms.describe_model(prompt, ms.input_link(prompt, "11", "model"), trained, resolve)
    assert source.loras == (*base.loras, (str(adapter), 1.0)) and source.path == base.path
    with pytest.raises(ms.Undescribable, match=r"node 10 .*patches differ"):  # another object than the recorded
        ms.describe_model(prompt, ["10", 0], FakeModel({"k": [1]}, uuid="another"), resolve)
    full = ms.trained_output_source(str(adapter), base, full=True, file_format="comfyui")
    assert (full.path, full.format, full.loras) == (str(adapter), "diffusion_model", ())
    assert ms.trained_output_source(str(adapter), base, full=False, file_format="diffusers") is None
    ms.record_trained_output("9", trained, None)
    with pytest.raises(ms.Undescribable, match=r"node 9 \(InGraphTrainLoRA\): its output was not recorded"):
        ms.describe_model(prompt, ["10", 0], trained, resolve)


def test_previews_vae_from_a_checkpoint_or_a_vae_file(files):
    made, resolve = files
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "base.safetensors"}},
              "2": {"class_type": "VAELoader", "inputs": {"vae_name": "kl.safetensors"}},
              "3": {"class_type": "VAELoader", "inputs": {"vae_name": "taesd"}}}
    assert ms.describe_vae(prompt, ["1", 2], resolve) == ms.VaeSource(made[("checkpoints", "base.safetensors")],
                                                                      "checkpoint")
    assert ms.describe_vae(prompt, ["2", 0], resolve) == ms.VaeSource(made[("vae", "kl.safetensors")], "vae")
    with pytest.raises(ms.Undescribable, match=r"node 3 \(VAELoader\): a built-in VAE"):
        ms.describe_vae(prompt, ["3", 0], resolve)


def test_materialised_copies_stay_under_the_cap_least_recently_used_first(tmp_path):
    for i, name in enumerate(["a", "b", "c", "d"]):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(b"0" * 1000)
        os.utime(path, ns=(10**18 + i, 10**18 + i))  # a oldest ... d newest
    os.utime(tmp_path / "a.safetensors")  # used now: the newest
    removed = materialise.evict_materialised(tmp_path, keep=tmp_path / "b.safetensors", cap_bytes=2000)
    assert [p.name for p in removed] == ["c.safetensors", "d.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors"]


# --- with ComfyUI ----------------------------------------------------------------------------------------------

@pytest.mark.comfyui
def test_release_leaves_comfyui_no_loaded_model(assets, caplog):
    from tools.bootstrap import bootstrap
    bootstrap()
    import comfy.model_management as mm
    import comfy.sd
    model = comfy.sd.load_checkpoint_guess_config(str(assets["checkpoint"]), output_vae=False, output_clip=False)[0]
    mm.load_models_gpu([model])
    assert any(m.model is model for m in mm.current_loaded_models)
    with caplog.at_level("INFO", logger="ingraph_trainer"):
        assert ms.release_comfy_models(GraphModel(model)) == 0
    assert not mm.current_loaded_models
    assert "ComfyUI holds 0 loaded model(s) as the trainer starts (the trained model: not loaded)" in caplog.text


def assert_out_of_clients_reach(comfy, client, model_copy: Path, manifest: Path):
    """The materialised copy (possibly a user's private merge) and the dataset cache live in the pack's data folder,
    which no ComfyUI route serves: a client can neither download them (GET /view) nor plant replacements
    (POST /upload/image with type=output), as it could while they lived under output/ingraph/."""
    import urllib.error
    data = comfy.base_dir / "ingraph_data"
    cache_db = json.loads(manifest.read_text())["cache_root"]
    assert model_copy.is_file() and model_copy.parent == data / "models"
    assert Path(cache_db) == data / "cache" and (data / "cache" / "cache.sqlite").is_file()
    assert not (comfy.base_dir / "output" / "ingraph" / "models").exists()
    assert not (comfy.base_dir / "output" / "ingraph" / "cache").exists()
    for subfolder, name in (("ingraph/models", model_copy.name), ("ingraph/cache", "cache.sqlite")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            client.get(f"/view?type=output&subfolder={subfolder}&filename={name}")
        assert refused.value.code in (400, 403, 404), (subfolder, refused.value.code)


def model_store_bytes(comfy) -> dict:
    root = comfy.base_dir / "ingraph_data" / "models"
    return {p.name: p.stat().st_size for p in root.glob("*.safetensors")} if root.is_dir() else {}


@pytest.mark.comfyui
def test_loader_chain_hands_off_files_and_an_undescribable_node_is_materialised(comfy, client, assets):
    """Load Checkpoint → Load LoRA 0.7 → Train writes no weights and describes checkpoint + LoRA 0.7; its output
    MODEL fed to Evaluate is that plus the new LoRA; a Model Merge upstream trains through a named fallback;
    ComfyUI holds no loaded model whenever a trainer starts."""
    write_upstream_lora(assets["checkpoint"], comfy.dir("models", "loras") / "h1_upstream.safetensors")
    wf = load_workflow()
    wf = {k: v for k, v in wf.items() if k in {"1", "2", "3", "4", "5", "6"}}
    wf["6"]["inputs"].update(steps=1, batch_size=1, precision="fp32", output_name="handoff_files")
    evaluate_on_one_image(wf)  # the Train node's own evaluations: not this test's point
    wf["20"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "strength_model": 0.7,
                                                       "lora_name": "h1_upstream.safetensors", "strength_clip": 0.0}}
    wf["6"]["inputs"]["model"] = ["20", 0]
    wf["30"] = {"class_type": "InGraphEvaluate", "inputs": {"model": ["6", 0], "dataset": ["4", 0],
                                                            "quantiles": "0.5", "seed": 0, "batch_size": 4,
                                                            "precision": "fp32"}}
    log_start = len(comfy.log_text())
    before = model_store_bytes(comfy)
    outcome = client.run(wf, timeout=600)
    assert outcome.ok, (outcome.status, outcome.error, comfy.log_tail())
    assert model_store_bytes(comfy) == before, "model weights were written for a MODEL from loader nodes"
    run_id = next(m["data"]["run_id"] for m in outcome.messages if m.get("type") == "ingraph.event")
    spec = tomllib.loads((comfy.base_dir / "output" / "ingraph" / "runs" / run_id / "run.toml").read_text())
    model = spec["model"]
    assert model["format"] == "checkpoint" and Path(model["path"]).name == "ingraph_tiny_sd15.safetensors"
    assert [Path(p).name for p in model["lora_paths"]] == ["h1_upstream.safetensors"]
    assert model["lora_strengths"] == [0.7] and len(model["stamps"]) == 2
    evals = sorted((comfy.base_dir / "output" / "ingraph" / "evals").glob("*/run.toml"), key=os.path.getmtime)
    evaluated = tomllib.loads(evals[-1].read_text())["model"]
    assert [Path(p).name for p in evaluated["lora_paths"]] == ["h1_upstream.safetensors", "handoff_files.safetensors"]
    assert evaluated["lora_strengths"] == [0.7, 1.0] and evaluated["format"] == "checkpoint"

    merged = copy.deepcopy(wf)
    del merged["30"]
    merged["21"] = {"class_type": "ModelMergeSimple", "inputs": {"model1": ["1", 0], "model2": ["20", 0],
                                                                 "ratio": 0.5}}
    merged["6"]["inputs"].update(model=["21", 0], output_name="handoff_merged")
    outcome = client.run(merged, timeout=600)
    assert outcome.ok, (outcome.status, outcome.error, comfy.log_tail())
    log = comfy.log_text()[log_start:]
    assert re.search(r"the model of node 6 is materialised: node 21 \(ModelMergeSimple\)", log), log[-3000:]
    written = set(model_store_bytes(comfy)) - set(before)
    assert len(written) == 1
    run_id = next(m["data"]["run_id"] for m in outcome.messages if m.get("type") == "ingraph.event")
    spec = tomllib.loads((comfy.base_dir / "output" / "ingraph" / "runs" / run_id / "run.toml").read_text())
    assert Path(spec["model"]["path"]).name in written and spec["model"]["lora_paths"] == []
    assert_out_of_clients_reach(comfy, client, Path(spec["model"]["path"]), Path(spec["data"]["manifest"]))
    starts = re.findall(r"ComfyUI holds (\d+) loaded model\(s\) as the trainer starts \(the trained model: (\w+)",
                        log)
    assert starts == [("0", "not")] * 3, starts  # two Train runs and one Evaluate


def test_tools_import_no_cycle():
    """tools/ modules import each other without a cycle (prepare_run uses cache_dataset; both use bootstrap)."""
    import ast
    tools = Path(__file__).resolve().parents[2] / "tools"
    graph = {}
    for path in tools.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tools."):
                names.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tools.")}
        graph[path.stem] = names

    def reaches(start, target, seen=()):
        return any(n == target or (n not in seen and reaches(n, target, (*seen, n))) for n in graph.get(start, ()))
    assert not [name for name in graph if reaches(name, name)]


def test_a_lora_file_rewritten_since_comfyui_loaded_it_is_not_described(tmp_path):
    """LoraLoader's output stays cached while a Train node rewrites the file under its name: the file on disk is
    then not what the MODEL holds, and the walk must not hand it to the trainer."""
    import torch
    from safetensors.torch import save_file
    lora = tmp_path / "loras" / "mine.safetensors"
    base = tmp_path / "checkpoints" / "base.safetensors"
    lora.parent.mkdir()
    base.parent.mkdir()
    base.write_bytes(b"")
    up, down = torch.randn(8, 2), torch.randn(2, 8)
    save_file({"diffusion_model.a.lora_up.weight": up, "diffusion_model.a.lora_down.weight": down}, str(lora))
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "base.safetensors"}},
              "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": "mine.safetensors",
                                                                    "strength_model": 1.0}}}
    resolve = {("checkpoints", "base.safetensors"): str(base), ("loras", "mine.safetensors"): str(lora)}.get

    class Adapter:  # what comfy.weight_adapter keeps: the loaded file's tensors
        def __init__(self, *tensors):
            self.weights = (*tensors, None, None, None, None)
    live = FakeModel({"diffusion_model.a.weight": [(1.0, Adapter(up.clone(), down.clone()), 1.0, None, None)]})
    source = ms.describe_model(prompt, ["2", 0], live, lambda folder, name: resolve((folder, name)))
    assert source.loras == ((str(lora), 1.0),)
    save_file({"diffusion_model.a.lora_up.weight": up + 1, "diffusion_model.a.lora_down.weight": down + 1}, str(lora))
    with pytest.raises(ms.Undescribable, match=r"mine\.safetensors on disk is not what the MODEL holds"):
        ms.describe_model(prompt, ["2", 0], live, lambda folder, name: resolve((folder, name)))


def test_a_stale_partial_copy_is_removed_and_a_fresh_one_kept(tmp_path):
    """A server killed while writing a copy leaves a temporary as large as the model; the store removes it once it
    is clearly no write in progress, and never one that may be."""
    stale, fresh = tmp_path / ".model-a1b2.partial", tmp_path / ".model-c3d4.partial"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"x" * 100)
    old = time.time() - materialise.STALE_PARTIAL_S - 60
    os.utime(stale, (old, old))
    keep = tmp_path / "k.safetensors"
    keep.write_bytes(b"x")
    materialise.evict_materialised(tmp_path, keep=keep, cap_bytes=10**9)
    assert not stale.exists() and fresh.exists() and keep.exists()


def test_a_base_file_rewritten_since_comfyui_loaded_it_is_not_described(tmp_path):
    """Issue 28, finding 9: ComfyUI's loader output stays cached while models/checkpoints/x.safetensors is replaced
    (a re-download); the trainer would rebuild from the new file and train silently on other weights. The walk
    compares a sample of the live MODEL's weights with the file's: the same weights pass (also held in fp8, as
    UNETLoader's weight_dtype keeps them), other weights make the MODEL undescribable, so it is materialised."""
    import types
    import torch
    from safetensors.torch import save_file
    base = tmp_path / "checkpoints" / "base.safetensors"
    base.parent.mkdir()
    generator = torch.Generator().manual_seed(0)
    weights = {f"blocks.{i}.weight": torch.randn(64, 64, generator=generator) for i in range(6)}
    save_file({f"model.diffusion_model.{k}": v.half() for k, v in weights.items()}, str(base))
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "base.safetensors"}}}
    resolve = lambda folder, name: str(base)  # noqa: E731

    def live(dtype):
        net = torch.nn.Module()
        net.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(6))
        for i, block in enumerate(net.blocks):
            block.weight = torch.nn.Parameter(weights[f"blocks.{i}.weight"].to(dtype), requires_grad=False)
        patcher = FakePatcher()
        patcher.model = types.SimpleNamespace(diffusion_model=net)
        return GraphModel(patcher)
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        assert ms.describe_model(prompt, ["1", 0], live(dtype), resolve).path == str(base)
    save_file({f"model.diffusion_model.{k}": torch.randn(64, 64, generator=generator).half() for k in weights},
              str(base))  # re-downloaded: other weights under the same name
    with pytest.raises(ms.Undescribable, match=r"base\.safetensors on disk is not what the MODEL holds"):
        ms.describe_model(prompt, ["1", 0], live(torch.float16), resolve)


# ComfyUI classes whose loader takes what the weights do not say from the file's "config" metadata: LTX-2's sizes,
# Wan's variants (ComfyUI 0.33's), and a Wan whose weights say everything (no metadata to write)
@pytest.mark.parametrize("class_name", ["LTXAV", "WAN_Animate2", "WAN21_CausalAR_T2V", "WAN21_FlowRVS",
                                        "WAN21_Camera"])
def test_a_materialised_copy_loads_as_the_graphs_model_where_the_file_it_came_from_said_its_sizes(tmp_path,
                                                                                                  class_name):
    """A MODEL no file describes (a patch node on the way) reaches the trainer as a copy of its weights: that copy
    carries the "config" metadata ComfyUI's loader needs for the same model (an LTX-2 copy without it would be
    built with ComfyUI's fixed 32 heads and fail to load; a Wan Animate one would load as plain Wan)."""
    from tools.bootstrap import bootstrap
    bootstrap()
    import comfy.supported_models
    import torch
    from safetensors import safe_open
    from tools.family_coverage import CLASS_BUILT, class_state_dict, load_model
    from ingraph_trainer.trainer.comfy_compat import load_model_file
    if not hasattr(comfy.supported_models, class_name):
        pytest.skip(f"this ComfyUI has no {class_name} (0.33 has; its tier runs this test)")
    built = class_state_dict(class_name, *CLASS_BUILT[class_name])
    state, metadata = built if isinstance(built, tuple) else (built, None)
    model = load_model(state, metadata)
    assert type(model.model.model_config).__name__ == class_name  # as the graph loaded it
    key, weight = next((k, w) for k, w in model.model.diffusion_model.state_dict().items() if w.dim() == 2)
    model.add_patches({f"diffusion_model.{key}": (torch.full_like(weight, 0.25),)}, 1.0)  # what a patch node adds
    path = materialise.materialise_model(GraphModel(model), tmp_path)
    with safe_open(str(path), "pt") as copy:  # metadata only where the weights alone load as something else
        assert ("config" in copy.metadata()) == (class_name != "WAN21_Camera"), copy.metadata()
    again = load_model_file(str(path), from_checkpoint=False, options={"dtype": torch.float32})
    assert type(again.model.model_config).__name__ == class_name
    assert again.model.model_config.unet_config == model.model.model_config.unet_config
    copied = again.model.diffusion_model.state_dict()
    assert torch.equal(copied[key], weight + 0.25)
    assert sorted(copied) == sorted(model.model.diffusion_model.state_dict())
