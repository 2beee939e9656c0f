"""The starting graphs for real models (tools/starting_graphs.py, issue 32): SD1.5, SDXL, Flux dev on an fp8 base,
Wan 2.2 5B video and Qwen-Image-Edit, and on ComfyUI 0.33 Flux.2 dev and Z-Image (issue 34). Every widget value is one the installed ComfyUI's /object_info accepts, and
each graph runs through the API with the family's tiny model, a synthetic text encoder and a tiny VAE in place of
the real files (everything else as shipped: the fp8 load, checkpointing, previews (one pass where the negative's
carries nothing of its own), accumulation), trains and
writes a LoRA with ComfyUI's keys: every graph on ComfyUI 0.33, the Flux fp8 one on 0.3.64 (TRAINED_HERE)."""
from __future__ import annotations

import copy
import json

import pytest
from safetensors.torch import load_file

from conftest import CHECKPOINT_NAME, ON_COMFYUI_033, REPO, comfyui_path, comfyui_version, tiny_models
from family_graphs import (EDIT_FOLDER, FAMILY_FOLDER, FAMILY_TINY_MODELS, IMAGE_TINY_MODELS, VAE_CHANNELS,
                           VIDEO_VAE_CHANNELS, merged, run_events)
from family_graphs import family_models, image_family_models, video_model_files, video_models_in_server  # noqa: F401
from tools.starting_graphs import RECIPES, api_graph, needs_comfyui

# the 0.33 families' tiny models (tools/tiny_models.py: Z-Image is one of its VARIANTS), in bf16
DAY0_TINY_MODELS = dict(families={"flux2": "bf16", "z_image": "bf16"})
pytestmark = [pytest.mark.comfyui, pytest.mark.tiny_models(**FAMILY_TINY_MODELS),
              pytest.mark.tiny_models(**IMAGE_TINY_MODELS),
              *([pytest.mark.tiny_models(**DAY0_TINY_MODELS)] if ON_COMFYUI_033 else [])]

FILE_INPUTS = {"ckpt_name", "unet_name", "clip_name", "clip_name1", "clip_name2", "vae_name",
               "text_encoder"}  # the user's files
# graph → (the family the trainer should find, the tiny diffusion model, synthetic text family, VAE, image folder);
# SD1.5 keeps its checkpoint loader, with the suite's tiny checkpoint
STAND_INS = {
    "start_sd15_lora": ("sd_unet", None, None, None, FAMILY_FOLDER),
    "start_sdxl_lora": ("sdxl", "tiny_sdxl.safetensors", "sdxl", "tiny_taesd4.safetensors", FAMILY_FOLDER),
    "start_flux_dev_lora_fp8": ("flux", "tiny_flux.safetensors", "flux", "tiny_taesd16.safetensors", FAMILY_FOLDER),
    "start_wan22_5b_video_lora": ("wan", "tiny_wan22_ti2v.safetensors", "wan", VIDEO_VAE_CHANNELS[48],
                                  FAMILY_FOLDER),
    "start_qwen_image_edit_lora": ("qwen_image", "tiny_qwen_image.safetensors", "qwen_image",
                                   "tiny_wan_vae.safetensors", EDIT_FOLDER),
    # ComfyUI 0.33's: the tiny models are put in by day0_models below; Flux.2's VAE is the 128-channel TAE
    "start_flux2_dev_lora": ("flux2", "tiny_flux2.safetensors", "flux2", VAE_CHANNELS[128], FAMILY_FOLDER),
    "start_z_image_lora": ("lumina2", "tiny_z_image.safetensors", "z_image", VAE_CHANNELS[16], FAMILY_FOLDER),
    # LTX-2: the tiny one that tests/helpers/family_graphs.py writes (sized by its file's metadata), LTX-2's TAE
    "start_ltx2_video_lora": ("ltxav", "tiny_ltxav.safetensors", "ltxav", VIDEO_VAE_CHANNELS[128], FAMILY_FOLDER),
}
# the recipes this ComfyUI loads (Flux.2 and Z-Image: 0.33 and later)
HERE = sorted(name for name, recipe in RECIPES.items() if needs_comfyui(recipe) <= comfyui_version(comfyui_path()))
# the graphs each ComfyUI trains: every one on 0.33 (what users run); on 0.3.64 one of them, the one with the most of
# the shipped settings (the fp8 load, checkpointing, previews), as a check that an older ComfyUI runs a starting graph
# at all (each family's training on 0.3.64: test_model_families, test_image_families, test_video_families; suite time)
TRAINED_HERE = HERE if ON_COMFYUI_033 else ["start_flux_dev_lora_fp8"]

def shipped(name: str) -> dict:
    return json.loads((REPO / "workflows" / "api" / f"{name}_api.json").read_text())


def test_the_shipped_files_are_the_recipes():
    assert sorted(STAND_INS) == sorted(RECIPES)
    assert len(HERE) == len(RECIPES) - (0 if ON_COMFYUI_033 else 3), HERE
    for name, recipe in RECIPES.items():
        assert shipped(name) == api_graph(recipe), f"{name}: run python tools/starting_graphs.py"


def _problem(spec, value) -> str | None:
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
    if isinstance(kind, list):
        return None if value in kind else f"{value!r} is not one of {kind}"
    if kind == "COMBO":  # ComfyUI 0.33's form of a combo
        return None if value in options.get("options", []) else f"{value!r} is not one of {options.get('options')}"
    if kind in ("INT", "FLOAT"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "INT" and not
                                                                             isinstance(value, int)):
            return f"{value!r} is not an {kind}"
        if not options.get("min", -float("inf")) <= value <= options.get("max", float("inf")):
            return f"{value} is outside [{options.get('min')}, {options.get('max')}]"
        return None
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{value!r} is not a BOOLEAN"
    if kind == "STRING":
        return None if isinstance(value, str) else f"{value!r} is not a STRING"
    return f"{value!r} given for a {kind} input, which takes a link"


def test_every_widget_value_is_one_the_installed_comfyui_accepts(client):
    """Each node exists, each input it is given is one of its inputs, every required input is there, and each
    widget value is of the input's type, inside its range and among its options; a model file input names a
    .safetensors file (the user's files are not on this server)."""
    info = client.get("/object_info")
    for name in HERE:
        for node_id, node in shipped(name).items():
            where = f"{name} node {node_id} ({node['class_type']})"
            assert node["class_type"] in info, f"{where}: not a node of this ComfyUI"
            spec = info[node["class_type"]]["input"]
            every = {**spec.get("required", {}), **spec.get("optional", {})}
            missing = set(spec.get("required", {})) - set(node["inputs"])
            assert not missing, f"{where}: required inputs missing: {sorted(missing)}"
            for key, value in node["inputs"].items():
                assert key in every, f"{where}: {key} is not one of its inputs"
                if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                    continue  # a link
                if key in FILE_INPUTS:
                    assert isinstance(value, str) and value.endswith(".safetensors"), f"{where}: {key}={value!r}"
                    continue
                problem = _problem(every[key], value)
                assert problem is None, f"{where}: {key}: {problem}"


def with_tiny_stand_ins(name: str, graph: dict) -> dict:
    """The graph with the family's tiny files in place of the real ones, at 64 px for one step with no evaluation
    and one-pass previews; nothing else changes (precision, checkpointing, the fp8 load, previews, the adapter)."""
    graph = copy.deepcopy(graph)
    _, unet, text_family, vae, folder = STAND_INS[name]
    if unet is None:
        graph["1"]["inputs"]["ckpt_name"] = CHECKPOINT_NAME
    else:
        weight_dtype = graph["1"]["inputs"].get("weight_dtype", "default")
        graph["1"] = {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": weight_dtype}}
        graph["2"] = {"class_type": "InGraphTestSyntheticTextEncoder", "inputs": {"family": text_family}}
        graph["3"] = {"class_type": "VAELoader", "inputs": {"vae_name": vae}}
        for node in graph.values():  # a checkpoint loader's CLIP and VAE outputs now come from their own loaders
            for key, value in node["inputs"].items():
                if value in (["1", 1], ["1", 2]):
                    node["inputs"][key] = ["2", 0] if value == ["1", 1] else ["3", 0]
    graph["4"]["inputs"].update(folder=folder, resolution=64, min_side=64, max_side=256)
    # previews as shipped but for their cost: one sampler step, without the negative prompt's pass (cfg 1) except
    # where that pass carries something of its own (Qwen-Image-Edit's: the reference latents)
    graph["8"]["inputs"].update(width=64, height=64, steps=1, every=1000)
    if name != "start_qwen_image_edit_lora":
        graph["8"]["inputs"]["cfg"] = 1.0
    graph["9"]["inputs"].update(steps=1, save_every=0, output_name=name, eval_items=0)
    return graph


@pytest.fixture(scope="module")
def day0_models(family_models, tools):  # noqa: F811
    """On ComfyUI 0.33: the tiny Flux.2 and Z-Image in the server's diffusion-models folder (built in the
    background from the session's start: conftest.tiny_models)."""
    if ON_COMFYUI_033:
        tiny_models(tools, family_models, **DAY0_TINY_MODELS)


def test_each_starting_graph_trains_with_tiny_stand_ins(family_models, video_models_in_server,  # noqa: F811
                                                         image_family_models, day0_models, client):  # noqa: F811
    comfy = family_models
    assert set(TRAINED_HERE) <= set(HERE)
    prompt = merged({name: with_tiny_stand_ins(name, shipped(name)) for name in TRAINED_HERE})
    outcome = client.run(prompt, timeout=1200)
    assert outcome.ok, outcome.error
    events = run_events(outcome)
    started = {e["run_dir"].rsplit("-start_", 1)[1].rsplit("-", 1)[0]: e for e in events if e["type"] == "started"}
    assert {f"start_{name}": e["family"] for name, e in started.items()} == \
        {name: STAND_INS[name][0] for name in TRAINED_HERE}, started
    finished = [e for e in events if e["type"] == "finished"]
    assert len(finished) == len(TRAINED_HERE)
    for name in TRAINED_HERE:
        adapter = load_file(str(comfy.base_dir / "models" / "loras" / f"{name}.safetensors"))
        assert adapter and all(k.startswith("diffusion_model.") for k in adapter), (name, sorted(adapter)[:3])
