"""Quantized bases (ComfyUI 0.33's `QuantizedTensor` layouts): a diffusion model file whose linear layers are stored
in a layout, written with ComfyUI's own quantization code (tools/quantized_models.py), trains a LoRA with its frozen
weights kept in that layout inside the trainer, dequantized layer by layer; the LoRA stays in full precision, the
loss stays close to the same run on the full-precision file, and the LoRA loads onto ComfyUI's own quantized MODEL
with every key and changes its output. ComfyUI 0.3.64 has no such layouts: the module is skipped there."""
from __future__ import annotations

import json
import logging
import sys

import pytest
import torch

from conftest import REPO, read_events, run_trainers_forked
from tools.comfy_server import comfyui_path

pytestmark = [pytest.mark.comfyui, pytest.mark.skipif(
    not (comfyui_path() / "comfy" / "quant_ops.py").is_file(),
    reason=f"skipped: the ComfyUI at {comfyui_path()} has no quantized layouts (comfy/quant_ops.py, 0.33 and later)")]

STEPS = 10
# the layouts ComfyUI 0.33 runs on a CPU (comfy-kitchen's eager backend); nvfp4 packs two values a byte, and
# ComfyUI's own detection then misreads an SD UNet's widths (a DiT's are read from other keys)
CPU_LAYOUTS = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "mxfp8")


@pytest.fixture(scope="module")
def quantized(assets, tools, tmp_path_factory):
    """The embedded default's diffusion model as a bf16 file, and a copy of it in each layout."""
    from safetensors.torch import load_file, save_file
    prefix = "model.diffusion_model."
    folder = tmp_path_factory.mktemp("quantized")
    source = folder / "tiny_unet.safetensors"
    save_file({k[len(prefix):]: v.to(torch.bfloat16) if v.is_floating_point() else v
               for k, v in load_file(assets["checkpoint"]).items() if k.startswith(prefix)}, source)
    report = json.loads(tools("quantized_models", ["--source", source, "--out", folder, "--layouts", *CPU_LAYOUTS],
                              timeout=600).strip().splitlines()[-1])
    assert set(report) == set(CPU_LAYOUTS)
    for layout, entry in report.items():
        assert entry["quantized_layers"] > 0 and entry["skipped_layers"] == 0, (layout, entry)
    return {"bf16": source, **{layout: folder / entry["path"].rsplit("/", 1)[-1] for layout, entry in report.items()}}


def _model_overrides(path) -> dict:
    return dict(model__path=str(path), model__format="diffusion_model", model__weight_dtype="default",
                model__lora_paths=[], model__lora_strengths=[], model__stamps=[])


@pytest.fixture(scope="module")
def runs(prepared, quantized):
    """10 fp32 LoRA steps on the bf16 file and on each quantized copy, same seed and data."""
    specs = {name: prepared(train__steps=STEPS, train__batch_size=2, train__precision="fp32", adapter__rank=4,
                            adapter__alpha=4.0, train__eval_quantiles=[0.5], **_model_overrides(path))
             for name, path in quantized.items()}
    proc = run_trainers_forked(*specs.values())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: read_events(spec.parent) for name, spec in specs.items()}


@pytest.mark.parametrize("layout", CPU_LAYOUTS)
def test_a_lora_trains_on_a_quantized_base_like_on_bf16(runs, layout):
    losses = {name: [e["loss"] for e in runs[name] if e["type"] == "step"] for name in ("bf16", layout)}
    assert len(losses[layout]) == len(losses["bf16"]) == STEPS
    mean = {name: sum(values) / len(values) for name, values in losses.items()}
    assert abs(mean[layout] - mean["bf16"]) <= 0.05 * mean["bf16"], losses
    started = {name: runs[name][0] for name in ("bf16", layout)}
    assert started[layout]["type"] == "started" and started[layout]["adapted_modules"] > 0
    # the quantized layers stay in their layout: fewer base bytes than the same model with them in full precision
    quantized_bytes, full_bytes = started[layout]["base_weight_bytes"], started["bf16"]["base_weight_bytes"]
    print(f"{layout}: base weights {quantized_bytes} bytes, the bf16 file's held in fp32 {full_bytes} "
          f"({quantized_bytes / full_bytes:.3f}x); mean loss {mean[layout]:.5f} against {mean['bf16']:.5f}")
    assert quantized_bytes < full_bytes
    assert runs[layout][-1]["type"] == "finished"


@pytest.mark.parametrize("layout", ("int8_tensorwise", "float8_e4m3fn"))
def test_the_lora_loads_onto_comfyuis_quantized_model_and_changes_it(runs, quantized, layout, tmp_path, caplog):
    lora = runs[layout][-1]["adapter"]
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.model_management
    import folder_paths
    import nodes
    from ingraph_trainer.trainer.comfy_compat import is_quantized
    folder_paths.add_model_folder_path("diffusion_models", str(quantized[layout].parent))
    folder_paths.add_model_folder_path("loras", str(tmp_path))
    (tmp_path / "quantized_lora.safetensors").write_bytes(open(lora, "rb").read())
    model = nodes.UNETLoader().load_unet(quantized[layout].name, "default")[0]
    assert any(is_quantized(m.weight) for m in model.model.diffusion_model.modules()
               if getattr(m, "weight", None) is not None)
    with caplog.at_level(logging.WARNING):
        patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, "quantized_lora.safetensors", 1.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()
                or "NOT LOADED" in r.getMessage()], caplog.text
    assert len(patched.patches) == runs[layout][0]["adapted_modules"] > 0

    g = torch.Generator().manual_seed(0)
    x, context = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 3, 768, generator=g)
    outputs = []
    for patcher in (model, patched):
        comfy.model_management.load_models_gpu([patcher])
        with torch.no_grad():
            outputs.append(patcher.model.apply_model(x, torch.tensor([0.5]), c_crossattn=context).float())
        comfy.model_management.unload_all_models()
    assert torch.isfinite(outputs[1]).all()
    assert (outputs[1] - outputs[0]).abs().max() > 1e-4


def _quantized_family(quantized, layout):
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.sd
    from ingraph_trainer.trainer.models import family_for
    return family_for(comfy.sd.load_diffusion_model(str(quantized[layout])).model, prediction="epsilon")


def test_other_adapter_kinds_are_refused_at_queue_time_naming_the_layout(quantized):
    from ingraph_trainer.trainer.config import AdapterSpec, RunSpec
    from ingraph_trainer.trainer.models import UnsupportedSetting
    family = _quantized_family(quantized, "int8_tensorwise")
    family.check_settings(RunSpec(adapter=AdapterSpec(kind="lora")))
    for kind in ("lokr", "loha", "dora", "full"):
        with pytest.raises(UnsupportedSetting, match=rf"adapter.kind: {kind} is not trained on quantized weights "
                                                     r"\(\S+ is stored as int8_tensorwise\)"):
            family.check_settings(RunSpec(adapter=AdapterSpec(kind=kind)))


def test_a_layout_the_device_cannot_run_is_refused_naming_it_and_the_device(quantized, monkeypatch):
    """As a GPU-only layout is on a CPU: the layout's kernels raise there (faked: ComfyUI 0.33 runs every layout
    it defines on the CPU, slowly)."""
    import comfy.quant_ops
    from ingraph_trainer.trainer.config import AdapterSpec, RunSpec
    from ingraph_trainer.trainer.models import UnsupportedSetting
    family = _quantized_family(quantized, "mxfp8")
    real = comfy.quant_ops.QuantizedTensor.from_float

    def no_kernel(tensor, layout, *args, **kwargs):
        if layout == "TensorCoreMXFP8Layout":
            raise NotImplementedError("no mxfp8 kernel for this device")
        return real(tensor, layout, *args, **kwargs)
    monkeypatch.setattr(comfy.quant_ops.QuantizedTensor, "from_float", staticmethod(no_kernel))
    with pytest.raises(UnsupportedSetting, match=r"model: \S+ is stored as mxfp8, which does not run on cpu "
                                                 r"\(NotImplementedError: no mxfp8 kernel for this device\)"):
        family.check_settings(RunSpec(adapter=AdapterSpec(kind="lora")))
