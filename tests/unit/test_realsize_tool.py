"""tools/realsize_models.py: the real-size layouts are what ComfyUI's own detection takes for SD1.5 and SDXL,
checked on the meta device (no 860M or 2.6B parameters allocated), and the streaming writer makes a valid
safetensors file."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.comfyui  # the layouts come from ComfyUI's model classes


@pytest.fixture(scope="module")
def realsize():
    from tools import realsize_models
    return realsize_models


def test_sd15_layout_is_detected_as_the_full_sd15_checkpoint(realsize):
    import torch
    layout = realsize.sd15_layout()
    import comfy.model_detection
    import comfy.sd
    import comfy.supported_models
    config = comfy.model_detection.model_config_from_unet(layout, "model.diffusion_model.")
    assert type(config) is comfy.supported_models.SD15
    assert config.unet_config["channel_mult"] == [1, 2, 4, 4] and config.unet_config["num_res_blocks"] == [2, 2, 2, 2]
    assert realsize.parameter_count(layout, "model.diffusion_model.") == 859_520_964  # SD1.5's UNet
    assert realsize.parameter_count(layout, "cond_stage_model.") == 123_060_480  # CLIP-L's text model

    # the CLIP Load Checkpoint builds for it takes every text-encoder key, lacking only what SD1.5 files lack
    clip_state = config.process_clip_state_dict({k: v for k, v in layout.items() if k.startswith("cond_stage_model.")})
    with torch.device("meta"):
        clip = config.clip_target(layout).clip(device="meta", dtype=torch.float16)
    expected = set(clip.state_dict())
    assert set(clip_state) <= expected
    assert expected - set(clip_state) == {"clip_l.transformer.text_projection.weight", "clip_l.logit_scale"}

    # the VAE Load Checkpoint builds is the SD KL autoencoder, with exactly these keys
    vae_state = {k[len("first_stage_model."):]: v for k, v in layout.items() if k.startswith("first_stage_model.")}
    with torch.device("meta"):
        vae = comfy.sd.VAE(sd=vae_state)
    assert type(vae.first_stage_model).__name__ == "AutoencoderKL" and vae.latent_channels == 4
    assert set(vae.first_stage_model.state_dict()) == set(vae_state)


def test_sdxl_layout_is_detected_as_the_full_sdxl_unet(realsize):
    layout = realsize.sdxl_unet_layout()
    import comfy.model_detection
    import comfy.supported_models
    config = comfy.model_detection.model_config_from_unet(layout, "")
    assert type(config) is comfy.supported_models.SDXL
    assert realsize.parameter_count(layout) == 2_567_463_684  # SDXL base's UNet


def test_streamed_file_is_valid_safetensors_with_the_layout_and_seeded_values(realsize, tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    with torch.device("meta"):
        layout = {"block.conv.weight": torch.empty(8, 4, 3, 3), "block.conv.bias": torch.empty(8),
                  "block.norm.weight": torch.empty(8), "block.proj.weight": torch.empty(16, 8)}
    first = realsize.write_random_safetensors(layout, tmp_path / "a.safetensors", "bf16", seed=3)
    again = realsize.write_random_safetensors(layout, tmp_path / "b.safetensors", "bf16", seed=3)
    other = realsize.write_random_safetensors(layout, tmp_path / "c.safetensors", "bf16", seed=4)
    tensors = load_file(first)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == \
        {k: (tuple(v.shape), torch.bfloat16) for k, v in layout.items()}
    assert torch.all(tensors["block.conv.bias"] == 0) and torch.all(tensors["block.norm.weight"] == 1)
    std = tensors["block.conv.weight"].float().std().item()
    assert 0.5 / 6 < std < 2 / 6  # fan-in scaled: 1/sqrt(4*3*3)
    assert first.read_bytes() == again.read_bytes() and first.read_bytes() != other.read_bytes()
    with safe_open(str(first), "pt") as f:
        assert f.metadata()["format"] == "pt"
    assert not list(tmp_path.glob("*.partial"))


def test_sdxl_checkpoint_layout_is_detected_with_both_text_encoders_and_the_vae(realsize):
    import torch
    import comfy.model_detection
    import comfy.sd
    import comfy.supported_models
    layout = realsize.sdxl_layout()
    config = comfy.model_detection.model_config_from_unet(layout, "model.diffusion_model.")
    assert type(config) is comfy.supported_models.SDXL
    assert realsize.parameter_count(layout, "model.diffusion_model.") == 2_567_463_684
    assert realsize.parameter_count(layout, "conditioner.embedders.0.") == 123_060_480  # CLIP-L's text model
    assert realsize.parameter_count(layout, "conditioner.embedders.1.") == 694_659_841  # bigG's, with its projection

    # Load Checkpoint's CLIP for it takes every text-encoder key, in its shape, lacking only what SDXL files lack
    clip_state = config.process_clip_state_dict({k: v for k, v in layout.items() if k.startswith("conditioner.")})
    with torch.device("meta"):
        clip = config.clip_target(layout).clip(device="meta", dtype=torch.float16)
    expected = clip.state_dict()
    assert set(clip_state) <= set(expected)
    assert set(expected) - set(clip_state) == {"clip_l.transformer.text_projection.weight", "clip_l.logit_scale"}
    assert all(tuple(v.shape) == tuple(expected[k].shape) for k, v in clip_state.items())

    vae_state = {k[len("first_stage_model."):]: v for k, v in layout.items() if k.startswith("first_stage_model.")}
    with torch.device("meta"):
        vae = comfy.sd.VAE(sd=vae_state)
    assert set(vae.first_stage_model.state_dict()) == set(vae_state)


def test_flux_layout_is_detected_as_flux_dev_and_shrinks_in_depth_only(realsize):
    import comfy.model_detection
    import comfy.supported_models
    layout = realsize.flux_layout()
    config = comfy.model_detection.model_config_from_unet(layout, "")
    assert type(config) is comfy.supported_models.Flux and config.unet_config["guidance_embed"] is True
    assert realsize.parameter_count(layout) == 11_901_408_320  # Flux.1-dev
    small = comfy.model_detection.model_config_from_unet(realsize.flux_layout(2, 1), "").unet_config
    assert (small["depth"], small["depth_single_blocks"], small["hidden_size"]) == (2, 1, 3072)


def test_fp8_file_keeps_matrices_in_float8_and_norms_in_bf16_and_the_pool_is_seeded(realsize, tmp_path):
    import torch
    from safetensors.torch import load_file
    with torch.device("meta"):
        layout = {"proj.weight": torch.empty(64, 32), "proj.bias": torch.empty(64), "norm.scale": torch.empty(32),
                  "conv.weight": torch.empty(8, 4, 3, 3)}
    first = realsize.write_random_safetensors(layout, tmp_path / "a.safetensors", "fp8", seed=1, values="pool")
    again = realsize.write_random_safetensors(layout, tmp_path / "b.safetensors", "fp8", seed=1, values="pool")
    other = realsize.write_random_safetensors(layout, tmp_path / "c.safetensors", "fp8", seed=2, values="pool")
    tensors = load_file(first)
    assert {k: v.dtype for k, v in tensors.items()} == {
        "proj.weight": torch.float8_e4m3fn, "conv.weight": torch.float8_e4m3fn, "proj.bias": torch.bfloat16,
        "norm.scale": torch.bfloat16}
    assert torch.all(tensors["norm.scale"] == 1) and torch.all(tensors["proj.bias"] == 0)
    std = tensors["proj.weight"].float().std().item()
    assert 0.5 / 32 ** 0.5 < std < 2 / 32 ** 0.5  # fan-in scaled through the pool too
    assert first.read_bytes() == again.read_bytes() and first.read_bytes() != other.read_bytes()
