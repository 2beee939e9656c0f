"""Quantized bases (ComfyUI 0.33's `QuantizedTensor` layouts): a diffusion model file whose linear layers are stored
in a layout, written with ComfyUI's own quantization code (tools/quantized_models.py), trains a LoRA with its frozen
weights kept in that layout inside the trainer, dequantized layer by layer; the LoRA stays in full precision, the
loss stays close to the same run on the full-precision file, and the LoRA loads onto ComfyUI's own quantized MODEL
with every key and changes its output. ComfyUI 0.3.64 has no such layouts: the module is skipped there."""
from __future__ import annotations

import json
import logging
import math
import sys

import pytest
import torch

from conftest import REPO, model_overrides, read_events, run_trainers_forked
from tools.comfy_server import comfyui_path

pytestmark = [pytest.mark.comfyui, pytest.mark.skipif(
    not (comfyui_path() / "comfy" / "quant_ops.py").is_file(),
    reason=f"skipped: the ComfyUI at {comfyui_path()} has no quantized layouts (comfy/quant_ops.py, 0.33 and later)")]

STEPS = 10
# the layouts ComfyUI 0.33 runs on a CPU (comfy-kitchen's eager backend); nvfp4 packs two values a byte, and
# ComfyUI's own detection then misreads an SD UNet's widths (a DiT's are read from other keys)
CPU_LAYOUTS = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "mxfp8")


@pytest.fixture(scope="module")
def quantized(tiny_unet, tools):
    """The embedded default's diffusion model as a bf16 file (test_fp8's), and a copy of it in each layout."""
    folder = tiny_unet.parent
    report = json.loads(tools("quantized_models", ["--source", tiny_unet, "--out", folder, "--layouts",
                                                   *CPU_LAYOUTS], timeout=600).strip().splitlines()[-1])
    assert set(report) == set(CPU_LAYOUTS)
    for layout, entry in report.items():
        assert entry["quantized_layers"] > 0 and entry["skipped_layers"] == 0, (layout, entry)
    return {"bf16": tiny_unet, **{layout: folder / entry["path"].rsplit("/", 1)[-1]
                                  for layout, entry in report.items()}}


@pytest.fixture(scope="module")
def runs(prepared, quantized):
    """10 fp32 LoRA steps on the bf16 file and on each quantized copy, same seed and data."""
    specs = {name: prepared(train__steps=STEPS, train__batch_size=2, train__precision="fp32", adapter__rank=4,
                            adapter__alpha=4.0, train__eval_quantiles=[0.5], **model_overrides(path, "default"))
             for name, path in quantized.items()}
    proc = run_trainers_forked(*specs.values())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: read_events(spec.parent) for name, spec in specs.items()}


@pytest.mark.parametrize("layout", CPU_LAYOUTS)
def test_a_lora_trains_on_a_quantized_base_like_on_bf16(runs, quantized, layout):
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
    # each quantized weight held as its layout's bytes (data and scales, as in the file) instead of fp32's 4 a weight
    from safetensors import safe_open
    saved = 0
    with safe_open(str(quantized[layout]), "pt") as f:
        layers = [k[:-len(".comfy_quant")] for k in f.keys() if k.endswith(".comfy_quant")]
        for layer in layers:
            weight = f.get_slice(f"{layer}.weight").get_shape()
            held = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()
                       if k.startswith(f"{layer}.weight"))
            saved += 4 * weight[0] * weight[1] - held
    assert layers and full_bytes - quantized_bytes == saved, (full_bytes, quantized_bytes, saved)
    assert runs[layout][-1]["type"] == "finished"


@pytest.mark.parametrize("layout", ("int8_tensorwise", "float8_e4m3fn"))
def test_the_lora_loads_onto_comfyuis_quantized_model_and_changes_it(runs, quantized, layout, tmp_path, caplog):
    lora = runs[layout][-1]["adapter"]
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
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

    assert_lora_changes_output(model, patched, (1, 4, 8, 8), (1, 3, 768), layout)


def assert_lora_changes_output(model, patched, latent_shape, text_shape, layout):
    """ComfyUI's own MODEL and the same with the LoRA loaded give finite outputs that differ."""
    import comfy.model_management
    g = torch.Generator().manual_seed(0)
    x, context = torch.randn(*latent_shape, generator=g), torch.randn(*text_shape, generator=g)
    outputs = []
    for patcher in (model, patched):
        comfy.model_management.load_models_gpu([patcher])
        with torch.no_grad():
            outputs.append(patcher.model.apply_model(x, torch.tensor([0.5]), c_crossattn=context).float())
        comfy.model_management.unload_all_models()
    assert torch.isfinite(outputs[1]).all() and (outputs[1] - outputs[0]).abs().max() > 1e-4, layout


def _quantized_family(quantized, layout):
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.sd
    from ingraph_trainer.trainer.models import family_for
    return family_for(comfy.sd.load_diffusion_model(str(quantized[layout])).model, prediction="epsilon")


def test_other_adapter_kinds_are_refused_at_queue_time_naming_the_layout(quantized):
    from ingraph_trainer.trainer.spec import AdapterSpec, RunSpec
    from ingraph_trainer.trainer.models import UnsupportedSetting
    family = _quantized_family(quantized, "int8_tensorwise")
    with torch.inference_mode():  # as ComfyUI runs every node
        for layout in CPU_LAYOUTS:  # a LoRA is taken, every layout running here
            _quantized_family(quantized, layout).check_settings(RunSpec(adapter=AdapterSpec(kind="lora")))
        for kind in ("lokr", "loha", "dora", "full"):
            with pytest.raises(UnsupportedSetting, match=rf"adapter.kind: {kind} is not trained on quantized "
                                                         r"weights \(\S+ is stored as int8_tensorwise\)"):
                family.check_settings(RunSpec(adapter=AdapterSpec(kind=kind)))


def test_a_layout_the_device_cannot_run_is_refused_naming_it_and_the_device(quantized, monkeypatch):
    """As a GPU-only layout is on a CPU: the layout's kernels raise there (faked: ComfyUI 0.33 runs every layout
    it defines on the CPU, slowly)."""
    import comfy.quant_ops
    from ingraph_trainer.trainer.spec import AdapterSpec, RunSpec
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


def test_a_quantized_layer_computes_with_its_weight_dequantized_and_the_lora_added(quantized):
    """The adapted layer's output is F.linear with the dequantized weight, plus the LoRA's term: ComfyUI's cast path,
    not its quantized-input path (which would quantize the activations the LoRA's gradient flows through)."""
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.comfy_compat import quantized_format
    family = _quantized_family(quantized, "float8_e4m3fn")
    targets = family.adapter_targets("attention")
    inject_adapter(family.diffusion_model, targets, "lora", 4, 4.0, 0.0)
    layer = family.diffusion_model.get_submodule(targets[0])
    base = layer.get_base_layer()
    assert quantized_format(base) == "float8_e4m3fn" and base.comfy_force_cast_weights
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # a LoRA that changes the output
    x = torch.randn(3, base.in_features, requires_grad=True)
    weight = base.weight.detach().dequantize().float()
    lora = layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
    expected = torch.nn.functional.linear(x, weight, base.bias) + lora
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert layer.lora_A["default"].weight.grad.abs().sum() > 0


def test_a_quantized_unet_trains_from_the_graph(comfy, client, quantized):
    """UNETLoader (a quantized file) → Train LoRA, as a user queues it: checked at queue time in ComfyUI's process
    (under inference_mode), trained, written."""
    from conftest import load_workflow
    link = comfy.dir("models", "diffusion_models") / "quantized_unet_int8.safetensors"
    if not link.exists():
        link.symlink_to(quantized["int8_tensorwise"])
    wf = load_workflow()
    wf = {k: v for k, v in wf.items() if k in {"1", "2", "3", "4", "5", "6", "7"}}  # no sampling tail
    wf["unet"] = {"class_type": "UNETLoader", "inputs": {"unet_name": link.name, "weight_dtype": "default"}}
    wf["6"]["inputs"].update(model=["unet", 0], steps=3, output_name="quantized_graph", precision="fp32",
                             eval_quantiles="0.5")
    outcome = client.run(wf, timeout=600)
    assert outcome.ok, (outcome.status, outcome.error, comfy.log_tail())
    events = [m["data"]["event"] for m in outcome.messages if m.get("type") == "ingraph.event"]
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 2, 3]
    assert (comfy.base_dir / "models" / "loras" / "quantized_graph.safetensors").is_file()


# 4-bit layouts pack two values a byte, which ComfyUI's detection of an SD UNet reads as half its text width (it
# refuses the file); users' 4-bit files are DiTs, whose widths ComfyUI reads elsewhere: a small Wan (every linear
# layer's width a multiple of the layouts' blocks)
FOUR_BIT_LAYOUTS = ("nvfp4", "convrot_w4a4", "asym_w4a8_int8")
SMALL_WAN = dict(dim=256, ffn_dim=512, num_layers=2)


@pytest.fixture(scope="module")
def four_bit_wans(tmp_path_factory):
    """A small random Wan as an fp32 diffusion-model file and a copy in each 4-bit layout (ComfyUI's own code)."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.models.wan import WanFamily
    from tools.embedded_default import save_safetensors
    from tools.quantized_models import quantize_state
    folder = tmp_path_factory.mktemp("four_bit")
    state = WanFamily.scratch_state_dict(0, **SMALL_WAN)
    save_safetensors(state, folder / "wan_fp32.safetensors")
    files = {"fp32": folder / "wan_fp32.safetensors"}
    for layout in FOUR_BIT_LAYOUTS:
        quantized, count, skipped = quantize_state(state, layout)
        assert count > 0 and skipped == 0, (layout, count, skipped)
        files[layout] = folder / f"wan_{layout}.safetensors"
        save_safetensors(quantized, files[layout])
    return files


def _train_lora_in_process(path, steps: int = STEPS):
    """What the trainer does with a MODEL from this file, in this process: ComfyUI's loader, the family's checks
    (under inference_mode, as ComfyUI runs a node), a LoRA on every linear layer, AdamW on the family's loss, and
    half-way a preview's load of the model by ComfyUI."""
    import comfy.sd
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.spec import AdapterSpec, RunSpec
    from ingraph_trainer.trainer.models import Batch, family_for
    patcher = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
    family = family_for(patcher.model, patcher=patcher)
    with torch.inference_mode():
        family.check_settings(RunSpec(adapter=AdapterSpec(kind="lora")))
    family.prepare_for_training()
    targets = family.adapter_targets("all_linear")
    torch.manual_seed(0)
    params = inject_adapter(family.diffusion_model, targets, "lora", 4, 4.0, 0.0)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        if step == steps // 2:  # a preview: ComfyUI loads the training model (ModelPatcher.load resets its layers)
            import comfy.model_management
            from ingraph_trainer.trainer.sampling import on_the_trainers_device
            with on_the_trainers_device(family.patcher), torch.no_grad():
                comfy.model_management.load_models_gpu([family.patcher])
        batch = Batch(torch.randn(2, 16, 6, 10, generator=g), torch.randn(2, 8, 4096, generator=g), None,
                      torch.randn(2, 16, 6, 10, generator=g), torch.rand(2, generator=g))
        loss = family.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return family, targets, losses


def test_a_lora_trains_on_4_bit_bases_and_loads_onto_comfyuis_4_bit_model(four_bit_wans, caplog):
    """nvfp4, ConvRot w4a4 and asym w4a8 run on a CPU in ComfyUI 0.33 (comfy-kitchen's eager kernels): each trains
    a LoRA with its base weights kept 4-bit, within 5 % of the fp32 file's loss, and the LoRA loads onto
    ComfyUI's own 4-bit MODEL with every key and changes its output."""
    import comfy.sd
    from ingraph_trainer.trainer.adapters import comfy_adapter_state_dict
    from ingraph_trainer.trainer.comfy_compat import quantized_layouts, with_lora
    reference, _, reference_losses = _train_lora_in_process(four_bit_wans["fp32"])
    full_bytes = reference.base_weight_bytes()
    mean_reference = sum(reference_losses) / STEPS
    for layout in FOUR_BIT_LAYOUTS:
        family, targets, losses = _train_lora_in_process(four_bit_wans[layout])
        assert set(quantized_layouts(family.diffusion_model)) == {layout}
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
        mean = sum(losses) / STEPS
        held = family.base_weight_bytes()
        print(f"{layout}: base weights {held} bytes against fp32's {full_bytes} ({held / full_bytes:.3f}x); "
              f"mean loss over {STEPS} steps {mean:.5f} against {mean_reference:.5f}")
        assert held < 0.2 * full_bytes  # 4 bits and their scales a weight, against 32
        assert abs(mean - mean_reference) <= 0.05 * mean_reference, (layout, losses, reference_losses)

        lora = comfy_adapter_state_dict(family.diffusion_model, "lora", 4.0)
        model = comfy.sd.load_diffusion_model(str(four_bit_wans[layout]))  # UNETLoader, weight_dtype default
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            patched = with_lora(model, lora)
        assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()
                    or "NOT LOADED" in r.getMessage()], caplog.text
        assert len(patched.patches) == len(targets) > 0
        assert_lora_changes_output(model, patched, (1, 16, 1, 6, 10), (1, 8, 4096), layout)
