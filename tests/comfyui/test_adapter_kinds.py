"""Adapter kinds (LoRA, LoHa, LoKr, DoRA): trained through the graph, loaded by ComfyUI's own LoRA code.

The file is checked by what it does: the Evaluate node's loss of the MODEL that ComfyUI builds from
the file (Train LoRA's model output is ComfyUI's load_lora_for_models, what Load LoRA runs) equals
the trainer's own final evaluation with the peft adapter in place (both on one image: conftest.evaluate_on_one_image).
"""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from conftest import evaluate_on_one_image, load_workflow, on_033_tier_alone
from ingraph_trainer.trainer.spec import DEFAULT_EVAL_QUANTILES_TEXT

pytestmark = pytest.mark.comfyui

# the Train node's evaluations and the Evaluate node's, at the same points (the comparison's)
FIVE_QUANTILES = DEFAULT_EVAL_QUANTILES_TEXT
KEY_PARTS = {"LoRA": {"lora_up.weight", "lora_down.weight", "alpha"},
             "LoHa": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
             "LoKr": {"alpha"},  # plus lokr_w1 / lokr_w1_a+b and lokr_w2 / lokr_w2_a+b, as peft factors them
             "DoRA": {"lora_up.weight", "lora_down.weight", "alpha", "dora_scale"}}


# LoRA: test_comfyui_training, test_export_formats. LoHa and DoRA load through ComfyUI 0.33's LoRA code, what users run
# today; LoKr, whose keys peft factors in the most ways, through both ComfyUIs' (suite time)
@pytest.mark.parametrize("kind", [
    pytest.param("LoHa", marks=on_033_tier_alone("LoHa loads through ComfyUI's LoRA code")),
    "LoKr",
    pytest.param("DoRA", marks=on_033_tier_alone("DoRA loads through ComfyUI's LoRA code"))])
def test_adapter_kind_loads_in_comfyui_and_reproduces_the_trainer(kind, comfy, client):
    wf = {k: v for k, v in load_workflow().items() if k in {"1", "2", "3", "4", "5", "6"}}
    # LoHa and LoKr on convolutions too (kohya's LoCon); DoRA trains linear layers only
    targets = "all linear layers" if kind == "DoRA" else "all linear and convolution layers"
    wf["5"]["inputs"].update(kind=kind, rank=4, alpha=4.0, targets=targets)
    wf["6"]["inputs"].update(steps=3, learning_rate=1e-2, precision="fp32", output_name=f"kinds/{kind.lower()}",
                             batch_size=2, eval_before=True)
    wf["9"] = {"class_type": "InGraphEvaluate",
               "inputs": {"model": ["6", 0], "dataset": evaluate_on_one_image(wf, quantiles=FIVE_QUANTILES),
                          "quantiles": FIVE_QUANTILES, "seed": 0, "batch_size": 2, "precision": "fp32"}}
    log_before = len(comfy.log_text())
    outcome = client.run(wf, timeout=600)
    assert outcome.ok, (outcome.status, outcome.error, comfy.log_tail())
    finished = next(m["data"]["event"] for m in outcome.messages
                    if m.get("type") == "ingraph.event" and m["data"]["event"]["type"] == "finished")
    evaluated = next(d["output"]["evaluation"][0] for d in outcome.of_type("executed") if d["node"] == "9")
    assert evaluated["loss"] == pytest.approx(finished["eval_after"], rel=1e-6)
    assert evaluated["loss"] != pytest.approx(finished["eval_before"], rel=1e-4)  # the adapter changes the model
    assert "lora key not loaded" not in comfy.log_text()[log_before:]
    with safe_open(finished["adapter"], "pt") as f:
        keys = list(f.keys())
        algo = f.metadata()["ss_network_args"]
    parts = {".".join(k.split(".")[-2:]) if k.endswith(".weight") else k.split(".")[-1] for k in keys}
    assert KEY_PARTS[kind] <= parts and all(k.startswith("diffusion_model.") for k in keys)
    if kind == "LoKr":
        assert any(p.startswith("lokr_w1") for p in parts) and any(p.startswith("lokr_w2") for p in parts)
    assert f'"algo": "{kind.lower()}"' in algo
    if kind != "DoRA":  # the convolutions are in the file, in the layout ComfyUI applied above
        assert any(".in_layers.2." in k for k in keys) and any(".out.2." in k for k in keys), keys[:8]
        assert json.loads(algo)["conv_dim"] == "4"  # LoCon's metadata, as kohya writes it


def test_full_fine_tune_loads_through_unet_loader_and_reproduces_the_trained_weights(comfy, client):
    wf = {k: v for k, v in load_workflow().items() if k in {"1", "2", "3", "4", "5", "6"}}
    wf["5"]["inputs"]["kind"] = "Full fine-tune"
    wf["6"]["inputs"].update(steps=3, learning_rate=1e-4, precision="fp32", output_name="full/ft_test", batch_size=2,
                             eval_before=True)
    evaluate = {"dataset": evaluate_on_one_image(wf, quantiles=FIVE_QUANTILES), "quantiles": FIVE_QUANTILES, "seed": 0,
                "batch_size": 2, "precision": "fp32"}
    wf["9"] = {"class_type": "InGraphEvaluate", "inputs": {"model": ["6", 0], **evaluate}}
    outcome = client.run(wf, timeout=600)
    assert outcome.ok, (outcome.status, outcome.error, comfy.log_tail())
    finished = next(m["data"]["event"] for m in outcome.messages
                    if m.get("type") == "ingraph.event" and m["data"]["event"]["type"] == "finished")
    # the first diffusion-models folder (ComfyUI still names it models/unet)
    assert finished["adapter"].endswith("/full/ft_test.safetensors") and "/models/" in finished["adapter"]
    assert finished["eval_after"] < finished["eval_before"]
    from_node = next(d["output"]["evaluation"][0] for d in outcome.of_type("executed") if d["node"] == "9")
    assert from_node["loss"] == finished["eval_after"]  # the node's MODEL output carries the trained weights
    listed = client.get("/object_info/UNETLoader")["UNETLoader"]["input"]["required"]["unet_name"][0]
    assert "full/ft_test.safetensors" in listed
    # a new graph: the stock Load Diffusion Model node reads the file; same weights, bit for bit the same loss
    loaded = {k: wf[k] for k in ("1", "eval_2", "eval_3", "eval_4")}
    loaded["20"] = {"class_type": "UNETLoader", "inputs": {"unet_name": "full/ft_test.safetensors",
                                                           "weight_dtype": "default"}}
    loaded["21"] = {"class_type": "InGraphEvaluate", "inputs": {"model": ["20", 0], **evaluate}}
    outcome = client.run(loaded, timeout=600)
    assert outcome.ok, (outcome.status, outcome.error, comfy.log_tail())
    from_file = next(d["output"]["evaluation"][0] for d in outcome.of_type("executed") if d["node"] == "21")
    assert from_file == from_node
