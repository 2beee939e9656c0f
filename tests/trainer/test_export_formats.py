"""Adapter file formats, each read back by the tool it is for.

kohya (lora_unet_*) and diffusers (peft layout) files are loaded the way diffusers'
load_lora_weights loads them into a diffusers UNet carrying the same weights as the trained
model; its output must match ComfyUI's model with the same file applied by ComfyUI's loader,
which in turn matches the trainer's own (tests/comfyui/test_adapter_kinds.py).
"""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from conftest import read_events

pytestmark = pytest.mark.comfyui


@pytest.mark.parametrize("file_format,prefix", [("kohya", "lora_unet_"), ("diffusers", "unet.")])
def test_format_loads_in_diffusers_and_reproduces_comfyui(trained_in_format, tools, file_format, prefix):
    spec = trained_in_format(file_format)
    finished = next(e for e in read_events(spec.parent) if e["type"] == "finished")
    with safe_open(finished["adapter"], "pt") as f:
        keys = list(f.keys())
        meta = json.loads(f.metadata()["ingraph_trainer"])
    assert keys and all(k.startswith(prefix) for k in keys) and meta["format"] == file_format
    if file_format == "diffusers":
        assert not any(k.endswith(".alpha") for k in keys)
    from ingraph_trainer.trainer.spec import load_run_spec
    model = load_run_spec(spec).model.path
    out = tools("diffusers_roundtrip", ["--model", model, "--adapter", finished["adapter"]])  # the tool's own main
    result = json.loads(out.strip().splitlines()[-1])
    print(f"\n{file_format}: {result}")
    assert result["comfyui_keys_not_loaded"] == 0
    assert result["adapter_effect"] > 1e-2  # the adapter does something, so agreement means something
    assert result["max_abs_diff"] < 1e-4
