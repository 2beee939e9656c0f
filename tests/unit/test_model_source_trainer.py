"""The trainer's side of the model hand-off, in-process (no server, no trainer launch): it rebuilds the graph's
MODEL from the run spec's model source with ComfyUI's own loading and patching code, refuses a source file that
changed, and building a family on a live MODEL (what the ComfyUI process does for its settings check) changes
nothing in it."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import REPO

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def comfy_env():
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()


def _random_lora(patcher, seed: int, count: int = 4, rank: int = 2) -> dict[str, torch.Tensor]:
    """A LoRA with ComfyUI keys on the first attention layers of the model."""
    g = torch.Generator().manual_seed(seed)
    layers = [(name, m) for name, m in patcher.model.diffusion_model.named_modules()
              if isinstance(m, torch.nn.Linear) and ".attn" in name][:count]
    out = {}
    for name, layer in layers:
        out[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(rank, layer.in_features, generator=g) * 0.1
        out[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(layer.out_features, rank, generator=g) * 0.1
        out[f"diffusion_model.{name}.alpha"] = torch.tensor(float(rank))
    return out


def test_rebuild_equals_comfyuis_checkpoint_with_loras(comfy_env, assets, tmp_path):
    """Load Checkpoint → Load LoRA (0.7) → Load LoRA (a diffusers-layout file, 0.5, applied as ComfyUI's loader
    applies it: its peft-layout attention keys are not read): the trainer's weights are the weights ComfyUI's
    patched model computes with, with no copy of the model written anywhere."""
    import comfy.sd
    import comfy.utils
    from safetensors.torch import load_file, save_file

    from ingraph_trainer.trainer import export
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.models import file_stamp, load_family

    checkpoint = str(assets["checkpoint"])
    graph = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=False, output_clip=False)[0]
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    save_file(_random_lora(graph, 1), first)
    save_file(export.convert(_random_lora(graph, 2), "diffusers", export.diffusers_module_names(graph.model)), second)
    assert any(k.endswith(".lora_A.weight") for k in load_file(second))

    patched = graph
    for path, strength in ((first, 0.7), (second, 0.5)):
        lora = comfy.utils.load_torch_file(str(path), safe_load=True)  # what LoraLoaderModelOnly does
        patched = comfy.sd.load_lora_for_models(patched, None, lora, strength, 0.0)[0]
    patched.patch_model()  # ComfyUI's own patching, as when it loads the patched model whole
    expected = {k: v.clone() for k, v in patched.model.diffusion_model.state_dict().items()}
    patched.unpatch_model()
    unpatched = graph.model.diffusion_model.state_dict()

    files_before = set(tmp_path.iterdir())
    spec = ModelSpec(path=checkpoint, format="checkpoint", lora_paths=[str(first), str(second)],
                     lora_strengths=[0.7, 0.5], stamps=[file_stamp(p) for p in (checkpoint, first, second)])
    family = load_family(spec, precision="fp32")
    got = family.diffusion_model.state_dict()
    assert set(got) == set(expected)
    changed = [k for k in expected if not torch.equal(expected[k], unpatched[k])]
    assert len(changed) == 4  # both LoRAs patch the same four layers, in order
    for key, value in expected.items():
        assert got[key].dtype == torch.float32
        assert torch.allclose(got[key], value, atol=1e-6, rtol=0), key
    assert not family.patcher.patches and not family.patcher.backup  # baked in, no original kept alongside
    assert set(tmp_path.iterdir()) == files_before


def test_a_changed_source_file_is_refused_naming_it(comfy_env, assets, tmp_path):
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.models import check_stamps, file_stamp, load_family
    lora = tmp_path / "upstream.safetensors"
    lora.write_bytes(b"0" * 16)
    checkpoint = str(assets["checkpoint"])
    spec = ModelSpec(path=checkpoint, format="checkpoint", lora_paths=[str(lora)], lora_strengths=[1.0],
                     stamps=[file_stamp(checkpoint), file_stamp(lora)])
    check_stamps(spec)  # unchanged: passes
    st = lora.stat()
    os.utime(lora, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched, same size
    with pytest.raises(ValueError, match=rf"model.stamps: {lora}.* changed since the graph loaded it"):
        load_family(spec)


def _narrow_flux():
    """A ComfyUI Flux MODEL (model_base.Flux, what FluxFamily matches) 64 wide, one double and one single block."""
    import comfy.model_patcher
    import comfy.supported_models

    from ingraph_trainer.trainer.models.base import init_weights
    from comfy.ldm.flux.model import FluxParams
    from ingraph_trainer.trainer.comfy_compat import dit_config
    config = comfy.supported_models.Flux(dit_config(FluxParams, dict(
        image_model="flux", in_channels=16, out_channels=16, vec_in_dim=64, context_in_dim=4096, hidden_size=64,
        mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000,
        patch_size=2, qkv_bias=True, guidance_embed=True)))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    init_weights(model.diffusion_model, 0)
    return comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))


def test_family_and_settings_check_leave_the_graphs_flux_model_untouched(comfy_env):
    """What the ComfyUI process does with the graph's live MODEL (runner/train_run.py: family_for, then
    check_settings) leaves every block's forward the original bound method and the model's output identical;
    only the trainer's prepare_for_training patches them (once, however often it is called)."""
    from ingraph_trainer.trainer.spec import RunSpec
    from ingraph_trainer.trainer.models import family_for
    patcher = _narrow_flux()
    model = patcher.model.diffusion_model
    blocks = [*model.double_blocks, *model.single_blocks]
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 16, 6, 10, generator=g), torch.rand(1, generator=g), torch.randn(1, 8, 4096, generator=g))
    extra = dict(y=torch.randn(1, 64, generator=g), guidance=torch.ones(1))
    with torch.no_grad():
        before = model(*inputs, **extra)

    for _ in range(2):  # each queued run builds another family on the same MODEL
        family = family_for(patcher.model, patcher=patcher)
        assert family.name == "flux"
        family.check_settings(RunSpec())
    for block in blocks:
        assert "forward" not in vars(block)
        assert block.forward.__func__ is type(block).forward
    with torch.no_grad():
        assert torch.equal(model(*inputs, **extra), before)

    family.prepare_for_training()  # the trainer's own copy: patched, once
    family.prepare_for_training()
    assert all("forward" in vars(block) for block in blocks)
    wrapped = blocks[0].forward
    assert wrapped.__defaults__ is None and wrapped.__kwdefaults__["_forward"].__func__ is type(blocks[0]).forward
