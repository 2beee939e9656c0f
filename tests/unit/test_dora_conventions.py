"""Adapter files read right by each tool they are for: the kohya layout by LyCORIS (what kohya-based tools and
Forge use), the ComfyUI layout by the installed ComfyUI; DoRA's dora_scale in each one's own convention.

No trainer launch: the tiny SD1.5 model is loaded as the trainer loads it, adapters (LoRA, LoHa, LoKr, DoRA; all
but DoRA on convolutions too, as the "all linear and convolution layers" preset) are injected as the trainer injects them and given random non-zero weights, and the files are exported by the
trainer's own export code. "The trainer's output" is that peft-adapted model's output.
"""
from __future__ import annotations

import copy
import json
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.comfyui

KINDS = ("lora", "loha", "lokr", "dora")
RANK, ALPHA = 4, 8.0
TOLERANCE = 1e-6  # relative to the output's largest value


@pytest.fixture(scope="module")
def setup(assets):
    """The base family, a diffusers UNet with its weights (what LyCORIS is applied to), inputs, and for each kind
    the trained-like adapted model with its output."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import torch
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.models import load_family
    from tools.diffusers_roundtrip import diffusers_unet
    family = load_family(ModelSpec(path=str(assets["checkpoint"]), format="checkpoint"), precision="fp32")
    base = family.diffusion_model.eval()
    g = torch.Generator().manual_seed(0)
    context_dim = family.base_model.model_config.unet_config["context_dim"]
    inputs = (torch.randn(1, 4, 8, 8, generator=g), torch.tensor([300.0]), torch.randn(1, 4, context_dim, generator=g))
    linear = family.adapter_targets("all_linear")
    conv = [n for n in family.adapter_targets("all_layers") if n not in linear]
    # every kind of layer the presets train (time embedding, resnet embedding, attention, feed-forward, projections,
    # and for all but DoRA the convolutions: 3x3, 1x1, strided), a few of each: each adapted layer costs a forward
    # pass time, and a few prove the file's layout as well as all
    targets = linear[::max(1, len(linear) // 8)]
    conv_targets = conv[::max(1, len(conv) // 4)]
    assert {tuple(base.get_submodule(n).kernel_size) for n in conv_targets} >= {(1, 1), (3, 3)}, conv_targets
    adapted = {}
    for kind in KINDS:
        model = copy.deepcopy(base)
        params = inject_adapter(model, targets + (conv_targets if kind != "dora" else []), kind, RANK, ALPHA, 0.0)
        with torch.no_grad():  # as if trained: every adapter tensor non-zero (LoRA's up starts at zero)
            for p in params:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            model.eval()
            exact = copy.deepcopy(model).double()
            adapted[kind] = (model, model(*inputs[:2], context=inputs[2]),
                             exact(*(v.double() for v in inputs[:2]), context=inputs[2].double()))
    with torch.no_grad():
        base_out = base(*inputs[:2], context=inputs[2])
    return {"family": family, "inputs": inputs, "adapted": adapted, "base_out": base_out,
            "diffusers_unet": diffusers_unet(family.base_model)}


def _relative(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _export(setup, kind: str, file_format: str) -> dict:
    from ingraph_trainer.trainer import export
    from ingraph_trainer.trainer.adapters import comfy_adapter_state_dict
    model = setup["adapted"][kind][0]
    tensors = comfy_adapter_state_dict(model, kind, ALPHA, file_format)
    return export.convert(tensors, file_format, export.diffusers_module_names(setup["family"].base_model)
                          if file_format != "comfyui" else {})


def _comfyui_outputs(setup, tensors: dict, caplog):
    """The base model with the file applied by ComfyUI's own LoRA code (load_lora_for_models, what Load LoRA runs,
    then its calculate_weight on each patched weight), in float64 and as ComfyUI runs it (float32)."""
    import logging

    import torch
    import comfy.lora
    import comfy.sd
    from ingraph_trainer.trainer.export import split_key
    family = setup["family"]
    with caplog.at_level(logging.WARNING):
        patched, _ = comfy.sd.load_lora_for_models(family.patcher, None, tensors, 1.0, 0.0)
    assert "lora key not loaded" not in caplog.text
    assert len(patched.patches) == len({split_key(k)[0] for k in tensors})  # every layer of the file applies
    exact = copy.deepcopy(family.diffusion_model).double()
    weights = exact.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, patches in patched.patches.items():
            weight = weights[key[len("diffusion_model."):]]
            weight.copy_(comfy.lora.calculate_weight(patches, weight.detach().clone(), key,
                                                     intermediate_dtype=torch.float64))
        x, t, context = (v.double() for v in setup["inputs"])
        out64 = exact(x, t, context=context)
    patched.patch_model()
    try:
        with torch.no_grad():
            out32 = family.diffusion_model(*setup["inputs"][:2], context=setup["inputs"][2])
    finally:
        patched.unpatch_model()
    return out64, out32


def _trainer_output64(setup, kind: str):
    return setup["adapted"][kind][2]


def _compare_in_comfyui(setup, kind: str, tensors: dict, caplog, what: str) -> float:
    out64, out32 = _comfyui_outputs(setup, tensors, caplog)
    diff, diff32 = _relative(out64, _trainer_output64(setup, kind)), _relative(out32, setup["adapted"][kind][1])
    print(f"\n{what}: ComfyUI vs trainer {diff:.2e} relative in float64, {diff32:.2e} in float32")
    assert diff32 < 1e-5  # float32 rounding of two ways to compute the same weights, as ComfyUI runs it
    return diff


@pytest.mark.parametrize("kind", KINDS)
def test_kohya_layout_loads_in_lycoris_with_every_key_and_gives_the_trainers_output(setup, kind, monkeypatch):
    import torch
    from lycoris.kohya import LycorisNetworkKohya, create_network_from_weights
    # LyCORIS 4.1's default network (built first, then replaced by the file's layers) names the SD UNet's
    # time_embedding.linear_1 twice (by name and through its TimestepEmbedding class) and asserts; the file's
    # layers are matched by name over the whole UNet whatever this default is
    monkeypatch.setattr(LycorisNetworkKohya, "UNET_TARGET_REPLACE_NAME", [])
    tensors = {k: v.clone() for k, v in _export(setup, kind, "kohya").items()}
    assert all(k.startswith("lora_unet_") for k in tensors)
    unet = copy.deepcopy(setup["diffusers_unet"])
    network, _ = create_network_from_weights(1.0, None, None, None, unet, weights_sd=tensors)
    layers = {k.split(".")[0] for k in tensors}
    assert len(network.unet_loras) == len(layers)  # every layer of the file found its module in the UNet
    network.apply_to(None, unet, apply_text_encoder=False, apply_unet=True)
    incompatible = network.load_state_dict(tensors, strict=False)
    assert not incompatible.unexpected_keys  # every key of the file is one LyCORIS reads
    assert not [k for k in incompatible.missing_keys if not k.endswith(".scalar")]
    # in float64 (the file's float32 values exactly): two UNet implementations' float32 rounding alone differs by
    # some 1e-6, which would hide nothing but also prove nothing at that tolerance
    unet.double(), network.double()
    x, t, context = (v.double() for v in setup["inputs"])
    with torch.no_grad():
        theirs = unet(x, t, encoder_hidden_states=context).sample
    ours = _trainer_output64(setup, kind)
    diff, effect = _relative(theirs, ours), _relative(setup["adapted"][kind][1], setup["base_out"])
    print(f"\n{kind}: LyCORIS vs trainer {diff:.2e} relative (adapter effect {effect:.2e})")
    assert effect > 1e-2  # the adapter does something, so agreement means something
    assert diff < TOLERANCE


def test_a_kohya_layout_dora_file_continues_training_from_the_model_it_holds(setup, tmp_path):
    """adapter.init_from reads a DoRA file's dora_scale in the convention it was written in: the metadata's, else
    the layout's (kohya: the magnitude)."""
    import torch
    from safetensors.torch import save_file
    from ingraph_trainer.trainer import export
    from ingraph_trainer.trainer.adapters import inject_adapter, load_adapter_weights
    from ingraph_trainer.trainer.adapters import (DORA_NORM_METADATA_KEY, DORA_NORM_UPDATED, PACK_METADATA_KEY,
                                                  comfy_adapter_state_dict)
    model, ours = setup["adapted"]["dora"][:2]
    names = export.diffusers_module_names(setup["family"].base_model)
    save_file(_export(setup, "dora", "kohya"), str(tmp_path / "dora_kohya.safetensors"))
    # ComfyUI keys in the paper's convention, as a later ComfyUI's export would write them: the metadata says so
    save_file(comfy_adapter_state_dict(model, "dora", ALPHA, "kohya"), str(tmp_path / "dora_later_comfyui.safetensors"),
              metadata={PACK_METADATA_KEY: json.dumps({DORA_NORM_METADATA_KEY: DORA_NORM_UPDATED})})
    targets = [n for n, m in model.named_modules() if hasattr(m, "lora_magnitude_vector")]
    for name in ("dora_kohya", "dora_later_comfyui"):
        resumed = copy.deepcopy(setup["family"].diffusion_model)
        inject_adapter(resumed, targets, "dora", RANK, ALPHA / 2, 0.0)  # another alpha: the file's scale carries over
        load_adapter_weights(resumed, "dora", str(tmp_path / f"{name}.safetensors"), names)
        with torch.no_grad():
            diff = _relative(resumed.eval()(*setup["inputs"][:2], context=setup["inputs"][2]), ours)
        print(f"\n{name} file, continued: {diff:.2e} relative")
        assert diff < TOLERANCE


@pytest.mark.parametrize("kind", KINDS)
def test_comfyui_layout_gives_the_trainers_output_in_comfyui(setup, kind, caplog):
    tensors = _export(setup, kind, "comfyui")
    assert all(k.startswith("diffusion_model.") for k in tensors)
    assert _compare_in_comfyui(setup, kind, tensors, caplog, kind) < TOLERANCE


def _decompose_dividing_by(norm: str):
    """A stand-in for ComfyUI's weight_decompose (same signature and output-axis behaviour) that divides
    dora_scale by |W| ("base") or by |W + dW| ("updated")."""
    import torch

    def weight_decompose(dora_scale, weight, lora_diff, alpha, strength, intermediate_dtype, function):
        dora_scale = dora_scale.to(weight.device, intermediate_dtype)
        lora_diff *= alpha
        weight_calc = weight + function(lora_diff).type(weight.dtype)
        by = weight if norm == "base" else weight_calc
        row_norm = by.reshape(by.shape[0], -1).norm(dim=1, keepdim=True).reshape(by.shape[0], *[1] * (by.dim() - 1))
        weight_calc *= (dora_scale / (row_norm + torch.finfo(weight.dtype).eps)).type(weight.dtype)
        if strength != 1.0:
            weight_calc -= weight
            weight += strength * weight_calc
        else:
            weight[:] = weight_calc
        return weight
    return weight_decompose


def test_comfyui_layout_follows_what_comfyuis_own_decomposition_divides_by(setup, monkeypatch, caplog):
    import torch
    import comfy.weight_adapter.base
    import comfy.weight_adapter.lora
    from ingraph_trainer.trainer import adapters
    installed = adapters.comfyui_dora_norm()
    assert installed in (adapters.DORA_NORM_BASE, adapters.DORA_NORM_UPDATED)
    written = _export(setup, "dora", "comfyui")
    model = setup["adapted"]["dora"][0]
    magnitudes = {f"diffusion_model.{name[:-len('.lora_magnitude_vector.default.weight')]}.dora_scale": p.detach()
                  for name, p in model.named_parameters() if name.endswith("lora_magnitude_vector.default.weight")}
    assert set(magnitudes) == {k for k in written if k.endswith(".dora_scale")}

    def is_magnitude(tensors):
        return all(torch.allclose(tensors[k].reshape(-1), m.reshape(-1), rtol=1e-6, atol=0)
                   for k, m in magnitudes.items())
    # the paper's magnitude itself only where ComfyUI divides by the updated weight's norm
    assert is_magnitude(written) == (installed == adapters.DORA_NORM_UPDATED)

    other = adapters.DORA_NORM_UPDATED if installed == adapters.DORA_NORM_BASE else adapters.DORA_NORM_BASE
    # ComfyUI changes its convention: the probe sees it, the file follows, and ComfyUI (the changed one) still
    # computes the trainer's model from it
    for module in (comfy.weight_adapter.base, comfy.weight_adapter.lora):
        monkeypatch.setattr(module, "weight_decompose", _decompose_dividing_by(other))
    adapters.comfyui_dora_norm.cache_clear()
    try:
        assert adapters.comfyui_dora_norm() == other
        rewritten = _export(setup, "dora", "comfyui")
        assert is_magnitude(rewritten) == (other == adapters.DORA_NORM_UPDATED)
        assert any(not torch.allclose(rewritten[k], written[k], rtol=1e-4) for k in magnitudes)
        assert _compare_in_comfyui(setup, "dora", rewritten, caplog, f"dora, dividing by the {other} norm") < TOLERANCE

        # neither convention: a clear error, no file
        monkeypatch.setattr(comfy.weight_adapter.base, "weight_decompose", lambda scale, weight, *args: weight * 3)
        adapters.comfyui_dora_norm.cache_clear()
        with pytest.raises(RuntimeError, match=r"divides dora_scale by neither \|W\| nor \|W \+ dW\|"):
            _export(setup, "dora", "comfyui")
    finally:
        adapters.comfyui_dora_norm.cache_clear()  # the next caller asks the real one again


def test_all_layers_gives_3d_convolutions_to_lora_alone(setup):
    """"all linear and convolution layers": peft has 3-D convolution layers for LoRA only, so LoHa and LoKr leave a
    video model's Conv3d patch embedding out rather than fail in peft after the model has loaded."""
    import torch
    from types import SimpleNamespace
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.models.base import ModelFamily
    model = torch.nn.Sequential(torch.nn.Conv3d(4, 8, 1), torch.nn.Conv2d(8, 8, 3), torch.nn.Linear(8, 8))
    family = SimpleNamespace(diffusion_model=model)
    assert ModelFamily.adapter_targets(family, "all_layers") == ["0", "1", "2"]
    inject_adapter(copy.deepcopy(model), ["0", "1", "2"], "lora", 2, 2.0, 0.0)
    for kind in ("loha", "lokr"):
        targets = ModelFamily.adapter_targets(family, "all_layers", kind)
        assert targets == ["1", "2"], kind
        assert inject_adapter(copy.deepcopy(model), targets, kind, 2, 2.0, 0.0)  # peft builds every one


@pytest.mark.parametrize("file_format", ["kohya", "comfyui"])
def test_a_lora_with_convolutions_continues_from_its_file_in_a_family_without_diffusers_names(file_format, tmp_path):
    """adapter.init_from on a file of every layout, for a model whose kohya keys are its ComfyUI names (the DiT
    families have no diffusers names): linear and convolution layers start where the file's model ended."""
    import torch
    from safetensors.torch import save_file
    from ingraph_trainer.trainer import export
    from ingraph_trainer.trainer.adapters import comfy_adapter_state_dict, inject_adapter, load_adapter_weights
    torch.manual_seed(0)
    base = torch.nn.ModuleDict({"patch": torch.nn.Conv2d(4, 8, 3, padding=1),
                                "blocks": torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))})

    def forward(model, x):
        h = model["patch"](x).permute(0, 2, 3, 1)
        return model["blocks"](h)
    targets = ["patch", "blocks.0", "blocks.1"]
    trained = copy.deepcopy(base)
    with torch.no_grad():
        for p in inject_adapter(trained, targets, "lora", 2, 4.0, 0.0):
            p.add_(torch.randn(p.shape) * 0.1)
    path = tmp_path / f"lora_{file_format}.safetensors"
    save_file(export.convert(comfy_adapter_state_dict(trained, "lora", 4.0, file_format), file_format, {}), str(path))
    resumed = copy.deepcopy(base)
    inject_adapter(resumed, targets, "lora", 2, 2.0, 0.0)  # another alpha: the file's scale carries over
    load_adapter_weights(resumed, "lora", str(path), {})
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        assert torch.allclose(forward(resumed, x), forward(trained, x), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(forward(base, x), forward(trained, x), rtol=1e-3)


def test_the_diffusers_layout_of_a_lora_with_convolutions_gives_the_trainers_output_in_comfyui(setup, caplog):
    """The diffusers layout (alpha folded into lora_B, unet.* module names) of a LoRA on linear and convolution
    layers, read back as the pack reads any of its files (export.comfyui_readable), is the trainer's model in ComfyUI."""
    from ingraph_trainer.trainer import export
    tensors = _export(setup, "lora", "diffusers")
    assert any(v.dim() == 4 for v in tensors.values())  # the convolutions are in it
    readable = export.comfyui_readable(tensors, export.diffusers_module_names(setup["family"].base_model))
    assert _compare_in_comfyui(setup, "lora", readable, caplog, "lora, diffusers layout") < TOLERANCE
