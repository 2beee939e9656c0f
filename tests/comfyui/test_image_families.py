"""Image families beyond SD/SDXL/SD3/Flux (issue 15): Qwen-Image and Qwen-Image-Edit, Flux Kontext, Chroma, Lumina 2.

Each tiny model is the smallest ComfyUI's own loader still detects as its family (ComfyUI fixes their widths, so
each is 380-520M parameters, stored in bf16). Unit tests (no server) prove detection, adapter targets and that the
family's loss is the loss of ComfyUI's own sampler output (calc_cond_batch on CLIPTextEncode-style conditioning,
ReferenceLatent's `reference_latents` for the edit models); one graph prompt trains every family but Chroma 2 steps,
Chroma its own prompt (suite time, at CHAINS; INGRAPH_SKIP_CHROMA_GRAPH=1 skips it), and each LoRA loads through the
stock LoraLoaderModelOnly, unmatched keys none, and changes KSampler's output.

Qwen-Image-Edit and Flux Kontext share Qwen-Image's and Flux's architecture (ComfyUI detects them as those), so they
are the same families given reference images. HiDream is not here: ComfyUI fixes its depth (16 + 32 blocks) as well
as its width, so the smallest model it detects is the full 17B one.
"""
from __future__ import annotations

import json
import re
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ON_COMFYUI_033, SUITE_EVAL_QUANTILES, on_033_tier_alone, tiny_models
from ingraph_trainer.runner.evaluation_run import parse_quantiles
from ingraph_trainer.trainer.models import UnsupportedSetting
from ingraph_trainer.trainer.spec import DEFAULT_EVAL_QUANTILES_TEXT
from family_graphs import EDIT_FOLDER, EDIT_REFERENCE, IMAGE_FAMILIES, IMAGE_TINY_MODELS as TINY_MODELS, SINGLE_FOLDER
from family_graphs import image_family_models  # noqa: F401  (a fixture)
from family_graphs import bootstrap_comfy, sampling_graph, saved_latent, training_graph
from stage_boundaries import assert_stages_compute_the_models_loss

# Z-Image (ComfyUI 0.33's ZImage, the lumina2 family's variant): ComfyUI fixes its width, so the tiny one is 0.9B
# parameters, built once a session (the starting graphs' test runs it too)
Z_IMAGE_TINY_MODEL = dict(families={"z_image": "bf16"})
pytestmark = [pytest.mark.comfyui, pytest.mark.tiny_models(**TINY_MODELS),
              *([pytest.mark.tiny_models(**Z_IMAGE_TINY_MODEL)] if ON_COMFYUI_033 else [])]
# what the family's stock text encoder adds to CLIPTextEncode's conditioning beside the embedding
ENCODER_EXTRAS = {"chroma": {"pooled_output": None},  # T5 alone: no pooled vector
                  "lumina2": {"attention_mask": torch.ones((1, 8), dtype=torch.long)}}  # Gemma's mask


# graph chain → (tiny model and synthetic encoder family, VAE, image folder); the edit chains train on reference
# images: Qwen-Image-Edit with the Wan VAE Qwen-Image uses (5-D latents), Flux Kontext with the 16-channel TAESD.
# Chroma is not among them but trains on its own prompt (test_chroma_trains_in_the_graph_and_loads_in_lora_loader),
# which INGRAPH_SKIP_CHROMA_GRAPH=1 skips for suite time: its fixed 278M-parameter modulation network costs ~4.5 s
# on 2 cores a forward pass, and the run makes 4 (2 training steps, 1 evaluation quantile before and after).
# Skipped, what is Chroma's own (ComfyUI detects it and the trainer picks it, its loss is ComfyUI's sampler's, its
# out-of-place blocks pass gradients, its exported LoRA is read whole by ComfyUI's LoRA loading onto the layers
# trained) is still test_family_detected_and_its_loss_is_comfyuis. On ComfyUI 0.3.64 the graph run is left out for
# suite time (14 s) as well: that check runs there
CHAINS = {"lumina2": ("lumina2", "tiny_taesd16.safetensors", SINGLE_FOLDER),
          "qwen_image_edit": ("qwen_image", "tiny_wan_vae.safetensors", EDIT_FOLDER),
          "flux_kontext": ("flux", "tiny_taesd16.safetensors", EDIT_FOLDER)}


def _load(server, family: str):
    """ComfyUI's own loader (what UNETLoader runs) on the tiny file, in fp32, and the family the trainer picks."""
    import comfy.sd
    from ingraph_trainer.trainer.models import family_for
    path = server.dir("models", "diffusion_models") / f"tiny_{family}.safetensors"
    patcher = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
    return family_for(patcher.model, patcher=patcher)


def _batch(latent, text, pooled=None, references=()):
    from ingraph_trainer.trainer.models import Batch
    g = torch.Generator().manual_seed(0)
    return Batch(torch.randn(2, *latent, generator=g), torch.randn(2, *text, generator=g),
                 torch.randn(2, pooled, generator=g) if pooled else None, torch.randn(2, *latent, generator=g),
                 torch.rand(2, generator=g) * 0.8 + 0.1,
                 references=[torch.randn(2, *ref, generator=g) for ref in references] or None)


def comfyui_losses(family, batch, extras, model_references=None, inference: bool = False) -> torch.Tensor:
    """Per-sample loss of what ComfyUI's sampler computes for each item: its conditioning as CLIPTextEncode (+ the
    encoder's extras: a dict, or item -> dict, + ReferenceLatent's reference_latents) gives it, through the sampler's
    convert_cond, encode_model_conds (the model's extra_conds) and calc_cond_batch (apply_model); the model's
    prediction recovered from the denoised output ((x - denoised) / sigma: a flow model's velocity, an epsilon
    model's noise; v-prediction's from its calculate_denoised), against the family's target. `inference`: under torch.inference_mode, as ComfyUI samples (some
    extra_conds, such as Anima's, take another path there), else under no_grad (what a training run's would)."""
    import comfy.sampler_helpers
    import comfy.samplers
    assert family.prediction in ("flow", "epsilon", "v_prediction")
    base = family.base_model
    base.current_patcher = family.patcher  # what ComfyUI's sampling sets while a sampler runs
    with torch.inference_mode() if inference else torch.no_grad():
        x0, noise, sigma = family.noising(batch.latents, batch.noise, batch.timesteps)
        shape = (-1,) + (1,) * (x0.dim() - 1)
        x_noisy = base.model_sampling.noise_scaling(sigma.view(shape), noise, x0)
        target = family.target(x0, noise, sigma.view(shape))
        losses = []
        for i in range(x0.shape[0]):
            item = dict(extras(i) if callable(extras) else extras)
            if batch.pooled is not None:
                item["pooled_output"] = batch.pooled[i:i + 1]
            if batch.references:
                refs = model_references or (lambda r: r)
                item["reference_latents"] = [refs(ref[i:i + 1]) for ref in batch.references]
            conds = comfy.sampler_helpers.convert_cond([[batch.cond[i:i + 1], item]])
            conds = comfy.samplers.encode_model_conds(base.extra_conds, conds, x_noisy[i:i + 1], x0.device, "positive")
            denoised = comfy.samplers.calc_cond_batch(base, [conds], x_noisy[i:i + 1], sigma[i:i + 1], {})[0]
            if family.prediction == "v_prediction":  # V_PREDICTION.calculate_denoised solved for the output
                s2 = sigma[i] ** 2 + 1.0
                predicted = (x_noisy[i:i + 1] / s2 - denoised) * s2.sqrt() / sigma[i]
            else:
                predicted = (x_noisy[i:i + 1] - denoised) / sigma[i]
            losses.append(((predicted - target[i:i + 1]) ** 2).mean())
    return torch.stack(losses)


@pytest.mark.parametrize("name", list(IMAGE_FAMILIES))
def test_family_detected_and_its_loss_is_comfyuis(image_family_models, name, caplog):
    """ComfyUI's loader detects the tiny file as the family, the family picks it, every adapter preset finds
    layers, and the family's loss is the loss of ComfyUI's own sampler output for the same conditioning; split into
    pipeline stages (stage_boundaries: a boundary after every layer), the same loss (to 1e-6) (Chroma: its
    out-of-place blocks, installed for training, compute ComfyUI's blocks' values and pass gradients, and the LoRA
    file the trainer writes of it is read whole by ComfyUI's LoRA loading, each key patching the layer it trained:
    what the graph test proves for the other families through LoraLoaderModelOnly)."""
    bootstrap_comfy()
    family = _load(image_family_models, name)
    assert family.name == name and family.prediction == "flow"
    assert family.adapter_targets("attention") and \
        len(family.adapter_targets("attention_ff")) > len(family.adapter_targets("attention"))
    assert family.checkpoint_blocks()
    latent, text = IMAGE_FAMILIES[name]
    batch = _batch(latent, text)
    expected = comfyui_losses(family, batch, ENCODER_EXTRAS.get(name, {}))  # before the trainer patches anything
    family.prepare_for_training()
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (name, got, expected)
    if name != "chroma":  # Chroma's, 3072 wide here, at a narrow width: test_chroma_splits_into_stages_...
        assert_stages_compute_the_models_loss(family, batch)
    if name == "chroma":  # ComfyUI's own Chroma blocks add residuals in place: autograd refuses them
        first_adapted_layer_takes_gradients(family, batch)
        lora_loads_whole_in_comfyui(family, caplog)


# Chroma at a width ComfyUI's detection never builds (it fixes 3072 wide): 2 double and 2 single blocks, so every
# layer kind, the join between them, and each block's own slices of the shared modulation cross stage boundaries
NARROW_CHROMA = dict(in_channels=64, out_channels=64, in_dim=64, out_dim=128, hidden_dim=64, n_layers=1,
                     context_in_dim=64, hidden_size=128, mlp_ratio=2.0, num_heads=1, depth=2, depth_single_blocks=2,
                     axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, txt_ids_dims=[], vec_in_dim=None)


def test_chroma_splits_into_stages_each_block_taking_its_own_modulation():
    """Chroma's one modulation network runs in the first stage; its output for every block crosses the stages and
    each block takes its own slices there (ComfyUI's get_modulations): the loss through stage boundaries is the
    model's (to 1e-6), each layer computes with its own weights (stage_boundaries). The tiny Chroma above has one
    double block only."""
    bootstrap_comfy()
    from ingraph_trainer.trainer.models import family_for
    from ingraph_trainer.trainer.models.base import random_state_dict
    from tools.family_coverage import class_model
    for singles, layers in ((2, 6), (0, 4)):  # without single blocks the last layer joins the streams
        model = class_model("Chroma", dict(NARROW_CHROMA, depth_single_blocks=singles))
        model.diffusion_model.load_state_dict(random_state_dict(model.diffusion_model, 0))
        family = family_for(model)
        assert family.name == "chroma" and len(family.pipeline_layers()) == layers
        family.prepare_for_training()
        assert_stages_compute_the_models_loss(family, _batch((16, 6, 10), (8, 64)))


# ComfyUI 0.33's day-0 families built here (HunyuanVideo 1.5 a video one): family class, ComfyUI class, latent
# (C, [T,] H, W), text (tokens, width), what the stock conditioning adds (Flux.2: FluxGuidance's 1; HunyuanVideo 1.5:
# its encoder's missing pooled vector); each tiny model is a few million parameters
DAY0_FAMILIES = {"flux2": ("Flux2Family", "Flux2", (128, 4, 6), (7, 64), {"guidance": 1.0}),
                 "krea2": ("Krea2Family", "Krea2", (16, 1, 4, 6), (7, 320), {}),
                 "hunyuan_video15": ("HunyuanVideo15Family", "HunyuanVideo15", (32, 3, 4, 6), (7, 64),
                                     {"pooled_output": None})}  # its text encoder gives no pooled vector


def _assert_z_image_loss_is_comfyuis(family, latent: tuple):
    """The family's loss is ComfyUI's sampler's to 1e-6 on 8 tokens of Qwen3-4B's 2560-wide text, with the attention
    mask CLIPTextEncode hands Z-Image's extra_conds (which counts the text's tokens from it)."""
    batch = _batch(latent, (8, 2560))
    expected = comfyui_losses(family, batch, {"attention_mask": torch.ones((1, 8), dtype=torch.long)})
    family.prepare_for_training()
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)
    return batch


def test_z_image_is_detected_and_its_loss_is_comfyuis(image_family_models, tools):  # noqa: F811
    """Z-Image (ComfyUI 0.33): ComfyUI's loader detects the tiny file as ZImage, the lumina2 family takes it, and its
    loss is ComfyUI's sampler's to 1e-6 on CLIPTextEncode's conditioning of Qwen3-4B's 2560-wide text with its
    attention mask (which its extra_conds counts the text's tokens from)."""
    bootstrap_comfy()
    if not ON_COMFYUI_033:
        pytest.skip("skipped: this ComfyUI has no ZImage (0.33 and later have)")
    tiny_models(tools, image_family_models, **Z_IMAGE_TINY_MODEL)
    family = _load(image_family_models, "z_image")
    assert family.name == "lumina2" and type(family.base_model.model_config).__name__ == "ZImage"
    batch = _assert_z_image_loss_is_comfyuis(family, (16, 8, 8))
    assert_stages_compute_the_models_loss(family, batch)  # its padding tokens are the first stage's


def test_z_images_pixel_space_variant_trains_as_lumina_2_on_images_and_its_loss_is_comfyuis():
    """Z-Image's pixel-space variant (ComfyUI 0.33's ZImagePixelSpace, tools/family_coverage.py's tiny one: 0.9B
    parameters at the width ComfyUI fixes): the lumina2 family takes it (its extra_conds counts the text's tokens from
    the attention mask the family gives), it trains on 3-channel image-sized latents as the "pixel_space" VAE caches
    them, and its loss is ComfyUI's sampler's to 1e-6 through the model's clean-image output turned velocity."""
    from ingraph_trainer.trainer.models import family_for
    patcher = _class_built("ZImagePixelSpace")
    family = family_for(patcher.model, patcher=patcher)
    assert family.name == "lumina2" and type(patcher.model).__name__ == "ZImagePixelSpace"
    _assert_z_image_loss_is_comfyuis(family, (3, 32, 32))
    with pytest.raises(UnsupportedSetting, match="distributed.pipeline_stages: Z-Image's pixel-space variant"):
        family.pipeline_layers()


@pytest.mark.parametrize("name", list(DAY0_FAMILIES))
def test_day0_family_is_detected_its_loss_is_comfyuis_and_its_lora_loads_whole(name, caplog):
    """ComfyUI 0.33's new families (issue 34): the tiny model the family file builds is detected by ComfyUI as that
    class and picked by the family; its loss is ComfyUI's sampler's to 1e-6 (Flux.2: no pooled vector, the text
    padded to 512 tokens by its extra_conds, guidance 1; Krea 2: one-frame video latents, several encoder layers'
    text side by side; HunyuanVideo 1.5: 3 latent frames, its image-condition and mask inputs zeros as ComfyUI's
    concat_cond gives them for text-to-video), and split into pipeline stages the same (to 1e-6, stage_boundaries;
    Flux.2's shared modulation computed once and carried); an adapter on the image blocks trains; its LoRA file loads
    whole in ComfyUI."""
    bootstrap_comfy()
    import comfy.model_base
    import comfy.model_detection
    import comfy.sd
    from ingraph_trainer.trainer import models
    cls_name, comfy_class, latent, text, extras = DAY0_FAMILIES[name]
    if not hasattr(comfy.model_base, comfy_class):
        pytest.skip(f"skipped: this ComfyUI has no {comfy_class} (0.33 and later have)")
    builder = getattr(models, cls_name)
    torch.manual_seed(0)
    state = builder.scratch_state_dict(0, **builder.scratch_sizes["tiny"])
    assert type(comfy.model_detection.model_config_from_unet(state, "")).__name__ == comfy_class
    patcher = comfy.sd.load_diffusion_model_state_dict(state, model_options={"dtype": torch.float32})
    family = models.family_for(patcher.model, patcher=patcher)
    assert family.name == name and family.prediction == "flow"
    assert family.adapter_targets("attention") and \
        len(family.adapter_targets("attention_ff")) > len(family.adapter_targets("attention"))
    batch = _batch(latent, text)
    expected = comfyui_losses(family, batch, extras)
    family.prepare_for_training()
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)
    assert_stages_compute_the_models_loss(family, batch)
    if family.reference_input == "reference_latents":  # Flux.2's edits: a source image as ReferenceLatent gives it
        edit = _batch(latent, text, references=(latent,))
        expected = comfyui_losses(family, edit, extras)  # raw latents, as ReferenceLatent hands them
        with torch.no_grad():
            got = family.loss(edit, reduce=False)
            plain = family.loss(_batch(latent, text), reduce=False)
        assert torch.allclose(got, expected, rtol=1e-6, atol=0) and not torch.allclose(got, plain), (got, expected)
        assert_stages_compute_the_models_loss(family, edit)  # placed at the next index, ComfyUI's Flux.2 default
    first_adapted_layer_takes_gradients(family, batch)
    lora_loads_whole_in_comfyui(family, caplog)


@pytest.mark.parametrize("model", ["HunyuanVideo 1.5", "HunyuanImage 2.1"])
def test_a_mean_flow_hunyuan_model_is_refused_naming_the_model_not_failed_at_its_first_step(model):
    """The step-distilled releases of ComfyUI's HunyuanVideo layout (time_r_in, "meanflow" to ComfyUI's detection):
    HunyuanVideo 1.5's (its family) and HunyuanImage 2.1's (the generic family's) read the sampler's step schedule in
    their forward, which a training step has not: refused by check_settings (the node's and the trainer's check,
    before anything starts) with a message naming the model and what to train on, where their first step failed
    with KeyError 'sigmas'; the base releases are not refused."""
    bootstrap_comfy()
    import comfy.sd
    import comfy.supported_models
    from ingraph_trainer.trainer import models
    from ingraph_trainer.trainer.spec import RunSpec
    from tools.family_coverage import CLASS_BUILT, class_state_dict
    class_name = {"HunyuanVideo 1.5": "HunyuanVideo15", "HunyuanImage 2.1": "HunyuanImage21"}[model]
    if class_name not in {c.__name__ for c in comfy.supported_models.models}:
        pytest.skip(f"skipped: this ComfyUI has no {class_name} (0.33 and later have)")

    def family(meanflow: bool):
        if class_name == "HunyuanVideo15":
            builder = models.HunyuanVideo15Family
            state = builder.scratch_state_dict(0, **builder.scratch_sizes["tiny"], meanflow=meanflow)
        else:
            config, metadata = CLASS_BUILT[class_name]
            state = class_state_dict(class_name, {**config, "meanflow": meanflow}, metadata)
        patcher = comfy.sd.load_diffusion_model_state_dict(state, model_options={"dtype": torch.float32})
        assert type(patcher.model).__name__ == class_name  # precondition: detected as the model it stands for
        return models.family_for(patcher.model, patcher=patcher)
    mean_flow, base = family(meanflow=True), family(meanflow=False)
    assert mean_flow.diffusion_model.time_r_in is not None and base.diffusion_model.time_r_in is None
    assert mean_flow.name == {"HunyuanVideo15": "hunyuan_video15", "HunyuanImage21": "generic"}[class_name]
    base.check_settings(RunSpec())
    with pytest.raises(UnsupportedSetting, match=f"model: this {re.escape(mean_flow.display_name)} model is a "
                                                 "mean-flow .*train on the model's base release"):
        mean_flow.check_settings(RunSpec())
    mean_flow.prepare_for_training()  # why: what the refusal spares the user, still so in this ComfyUI
    latent, text = {"HunyuanVideo15": DAY0_FAMILIES["hunyuan_video15"][2:4],
                    "HunyuanImage21": ((64, 8, 8), (7, 3584))}[class_name]
    with pytest.raises(KeyError, match="sigmas"), torch.no_grad():
        mean_flow.loss(_batch(latent, text), reduce=False)


def first_adapted_layer_takes_gradients(family, batch):
    """The loss's gradient reaches the first layer the attention preset adapts (the rest frozen): the trainer's
    copy of the model passes gradients through every block before it."""
    family.diffusion_model.requires_grad_(False)
    weight = dict(family.diffusion_model.named_modules())[family.adapter_targets("attention")[0]].weight
    weight.requires_grad_(True)
    family.loss(batch).backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def lora_loads_whole_in_comfyui(family, caplog):
    """The trainer's adapter (attention preset, non-zero weights), as the ComfyUI-format file holds it, through what
    LoraLoaderModelOnly runs (comfy.sd.load_lora_for_models: the model's key map, convert_lora, load_lora): every key
    read, and one weight patch for each adapted layer, on that layer's weight."""
    import logging
    import comfy.lora
    import comfy.lora_convert
    from ingraph_trainer.trainer.adapters import comfy_adapter_state_dict, inject_adapter
    key_map = comfy.lora.model_lora_keys_unet(family.base_model, {})  # before peft renames the layers
    targets = family.adapter_targets("attention")
    for parameter in inject_adapter(family.diffusion_model, targets, "lora", 4, 4.0, 0.0):
        torch.nn.init.normal_(parameter.data, std=0.01)  # lora_B starts at zero: a trained update is not
    tensors = comfy_adapter_state_dict(family.diffusion_model, "lora", 4.0)
    assert tensors and all(k.startswith("diffusion_model.") for k in tensors), sorted(tensors)[:3]
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(comfy.lora_convert.convert_lora(tensors), key_map)
    assert "lora key not loaded" not in caplog.text, caplog.text[-2000:]
    assert set(patches) == {f"diffusion_model.{t}.weight" for t in targets}
    assert all(patch.weights[0].abs().max() > 0 for patch in patches.values())  # lora_up: the update is not zero


def test_qwen_image_edit_trains_on_reference_latents_as_comfyui_runs_them(image_family_models):
    """Qwen-Image-Edit: the batch's reference images (raw cached latents, two slots of another size than the
    target) reach the model as TextEncodeQwenImageEdit / ReferenceLatent hand them (Wan-VAE latents, 5-D), so the
    loss is ComfyUI's, and differs from the loss without them; through pipeline stages, the same loss (to 1e-6),
    on ComfyUI 0.33 with its other placements too (Qwen-Image-Edit 2511's timestep zero, Qwen-Image-Layered's
    negative indices)."""
    bootstrap_comfy()
    family = _load(image_family_models, "qwen_image")
    assert family.reference_input == "reference_latents"
    latent, text = IMAGE_FAMILIES["qwen_image"]
    batch = _batch(latent, text, references=[(16, 4, 6), (16, 6, 10)])
    expected = comfyui_losses(family, batch, {}, model_references=lambda ref: ref.unsqueeze(2))
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
        edit_references, batch.references = batch.references, None
        without = family.loss(batch, reduce=False)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)
    assert (got - without).abs().min() > 1e-4
    batch.references = edit_references
    family.prepare_for_training()  # as the trainer does (comfy-kitchen's rotary op given a backward on 0.33)
    assert_stages_compute_the_models_loss(family, batch)  # the references' patches appended in the first stage
    # ComfyUI 0.33's other defaults: Qwen-Image-Edit 2511's (the references take the timestep zero through every
    # block) and Qwen-Image-Layered's (each reference at the next negative index)
    for method in ("index_timestep_zero", "negative_index") if ON_COMFYUI_033 else ():
        family.diffusion_model.default_ref_method = method
        with torch.no_grad():
            placed = family.loss(batch, reduce=False)
        assert (placed - got).abs().min() > 1e-6, method
        assert_stages_compute_the_models_loss(family, batch)


def narrow_flux_model(guidance_embed: bool = True):
    """A 64-wide Flux built by ComfyUI's own Flux model config, random weights (ComfyUI's detection would read a Flux
    file as 3072 wide: detection of Flux is test_model_families')."""
    bootstrap_comfy()
    import comfy.supported_models
    from comfy.ldm.flux.model import FluxParams
    from ingraph_trainer.trainer.comfy_compat import dit_config
    from ingraph_trainer.trainer.models.base import init_weights
    config = comfy.supported_models.Flux(dit_config(FluxParams, dict(
        image_model="flux", in_channels=16, out_channels=16, vec_in_dim=64, context_in_dim=4096, hidden_size=64,
        mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000, patch_size=2,
        qkv_bias=True, guidance_embed=guidance_embed)))
    config.set_inference_dtype(torch.float32, None)
    base = config.get_model({})
    init_weights(base.diffusion_model, 0)
    return base


def test_flux_kontext_trains_on_reference_latents_as_comfyui_runs_them():
    """Flux Kontext (a Flux dev model to ComfyUI): reference latents reach the model as ReferenceLatent hands them,
    with FluxGuidance's guidance, so the loss is ComfyUI's; without references it is plain Flux; through pipeline
    stages, the same loss (to 1e-6). The model is a narrow Flux built by ComfyUI's own Flux model config
    (narrow_flux_model)."""
    base = narrow_flux_model()
    import comfy.model_patcher
    from ingraph_trainer.trainer.models import family_for
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    family = family_for(base, patcher=patcher)
    assert family.name == "flux" and family.reference_input == "reference_latents"
    batch = _batch((16, 6, 10), (8, 4096), pooled=64, references=[(16, 4, 6), (16, 6, 4)])
    expected = comfyui_losses(family, batch, {"guidance": family.guidance})
    family.prepare_for_training()
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
        references, batch.references = batch.references, None
        without = family.loss(batch, reduce=False)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)
    assert (got - without).abs().min() > 1e-4
    batch.references = references
    assert_stages_compute_the_models_loss(family, batch)  # placed beside each other in the first stage
    if ON_COMFYUI_033:  # its "uxo" placement (beyond the image), where a model's default names it
        family.diffusion_model.params.default_ref_method = "uxo"
        with torch.no_grad():
            assert (family.loss(batch, reduce=False) - got).abs().min() > 1e-6
        assert_stages_compute_the_models_loss(family, batch)


def edit_sampling_graph(family: str, vae: str, lora_name: str, prefix: str) -> dict:
    """Stock nodes only, with and without the LoRA: UNETLoader (+ LoraLoaderModelOnly) → KSampler → SaveLatent,
    where an edit model's prompt carries the source image as the stock edit workflow gives it (LoadImage →
    VAEEncode → ReferenceLatent)."""
    graph = sampling_graph(family, lora_name, f"{prefix}_lora")
    graph["13"]["inputs"]["cfg"] = 1.0  # one model call a step
    graph["23"] = {**graph["13"], "inputs": {**graph["13"]["inputs"], "model": ["1", 0]}}  # the same, no LoRA
    graph["24"] = {"class_type": "SaveLatent",
                   "inputs": {"samples": ["23", 0], "filename_prefix": f"latents/{prefix}_base"}}
    if vae:
        graph.update({
            "30": {"class_type": "LoadImage", "inputs": {"image": EDIT_REFERENCE}},
            "31": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
            "32": {"class_type": "VAEEncode", "inputs": {"pixels": ["30", 0], "vae": ["31", 0]}},
            "33": {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["10", 0], "latent": ["32", 0]}}})
        for sampler in ("13", "23"):
            graph[sampler]["inputs"]["positive"] = ["33", 0]
    return graph


@on_033_tier_alone("these families through the graph run; what is each family's own runs on both "
                   "(test_family_detected_and_its_loss_is_comfyuis, test_qwen_image_edit_trains_on_reference_latents_"
                   "as_comfyui_runs_them)")
def test_image_families_train_in_one_graph_and_load_in_lora_loader(image_family_models, client):
    """One prompt trains Lumina 2, Qwen-Image-Edit and Flux Kontext (the edit models on items with reference
    images; Chroma: its own test) 2 steps each (fp32, 64 px images, captions from a synthetic encoder of each family's
    width); each LoRA loads through the stock LoraLoaderModelOnly with no unmatched key and changes KSampler's output (the edit
    models': in the stock ReferenceLatent edit graph)."""
    comfy = image_family_models
    prompt = {}
    for chain, (family, vae, folder) in CHAINS.items():
        model = {"class_type": "UNETLoader", "inputs": {"unet_name": f"tiny_{family}.safetensors",
                                                        "weight_dtype": "default"}}
        graph = training_graph("flux", f"image_{chain}", model=model, text_family=family, batch_size=1)
        graph["2"]["inputs"]["vae_name"] = vae
        graph["4"]["inputs"]["folder"] = folder
        for node_id, node in graph.items():
            inputs = {k: [f"{chain}_{v[0]}", v[1]] if isinstance(v, list) else v for k, v in node["inputs"].items()}
            prompt[f"{chain}_{node_id}"] = {**node, "inputs": inputs}
    outcome = client.run(prompt, timeout=1800)
    assert outcome.ok, outcome.error
    for chain, (family, vae, folder) in CHAINS.items():
        started = trained_two_steps(comfy, outcome, f"{chain}_8", family, f"image_{chain}")
        if folder == EDIT_FOLDER:  # each item brought its name.ref.png into the run (Batch.references)
            manifest = json.loads((Path(started["run_dir"]) / "dataset.json").read_text())
            assert [item[manifest["fields"].index("references")] for item in manifest["items"]] == [1]
        lora_loads_and_changes_sampling(comfy, client, family, vae if folder == EDIT_FOLDER else None,
                                        f"image_{chain}")


def trained_two_steps(comfy, outcome, node: str, family: str, output_name: str) -> dict:
    """The run of Train node `node` started as the family, did 2 finite steps and wrote a ComfyUI-layout LoRA.
    Returns its `started` event."""
    events = [m["data"]["event"] for m in outcome.messages
              if m.get("type") == "ingraph.event" and m["data"]["node"] == node]
    started = next((e for e in events if e["type"] == "started"), None)
    assert started and started["family"] == family and started["prediction"] == "flow", (node, started, events[:3])
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in steps), steps
    # the Train node's eval_quantiles (training_graph's: SUITE_EVAL_QUANTILES) is where the run evaluated
    evals = [e for e in events if e["type"] == "eval"]
    points = [str(q) for q in parse_quantiles(SUITE_EVAL_QUANTILES)]
    assert SUITE_EVAL_QUANTILES != DEFAULT_EVAL_QUANTILES_TEXT  # else the input could be ignored unseen
    assert len(evals) == 1 and all(list(e["quantiles"]) == points for e in evals), evals  # after the last step
    adapter = load_file(str(comfy.base_dir / "models" / "loras" / f"{output_name}.safetensors"))
    assert adapter and all(k.startswith("diffusion_model.") for k in adapter), sorted(adapter)[:3]
    return started


def lora_loads_and_changes_sampling(comfy, client, family: str, vae: str | None, output_name: str,
                                    steps: int = 2, strength: float = 1.0) -> None:
    """One stock prompt samples with the LoRA `output_name` (LoraLoaderModelOnly at `strength`) and without it: the
    server logs no unmatched key (nor an error) for it, and the two outputs differ."""
    log_before = len(comfy.log_text())
    graph = edit_sampling_graph(family, vae, f"{output_name}.safetensors", output_name)
    graph["9"]["inputs"]["strength_model"] = strength
    for sampler in ("13", "23"):
        graph[sampler]["inputs"]["steps"] = steps
    result = client.run(graph, timeout=600)
    assert result.ok, result.error
    log = comfy.log_text()[log_before:]
    assert "lora key not loaded" not in log and "ERROR" not in log, log[-3000:]
    base, trained = saved_latent(comfy, f"{output_name}_base"), saved_latent(comfy, f"{output_name}_lora")
    assert base.shape == trained.shape and (base - trained).abs().max() > 1e-6, \
        f"{output_name}: the LoRA changed nothing"


@pytest.mark.skipif(os.environ.get("INGRAPH_SKIP_CHROMA_GRAPH") == "1",
                    reason="INGRAPH_SKIP_CHROMA_GRAPH=1: skipped for suite time (Chroma's fixed 278M-parameter "
                           "modulation network: about a minute and a half on 2 CPU cores)")
@pytest.mark.skipif(not ON_COMFYUI_033, reason="skipped: Chroma through the graph runs on ComfyUI 0.33, what users run "
                    "today (suite time); what is Chroma's own runs on both (test_family_detected_and_its_loss_is_"
                    "comfyuis[chroma])")
def test_chroma_trains_in_the_graph_and_loads_in_lora_loader(image_family_models, client):
    """Chroma on its own prompt (suite time: see CHAINS): 2 steps through the graph (fp32, one 64 px image, batch 1,
    captions from a synthetic T5-width encoder; the Train node's evaluations are on that one image), then one stock
    prompt samples 1 step (CFG 1: one model call) with the LoRA through LoraLoaderModelOnly and without it: no
    unmatched key, and the outputs differ."""
    comfy = image_family_models
    model = {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_chroma.safetensors", "weight_dtype": "default"}}
    graph = training_graph("flux", "image_chroma", model=model, text_family="chroma", batch_size=1)
    graph["2"]["inputs"]["vae_name"] = "tiny_taesd16.safetensors"
    graph["4"]["inputs"]["folder"] = SINGLE_FOLDER
    outcome = client.run(graph, timeout=1200)
    assert outcome.ok, outcome.error
    trained_two_steps(comfy, outcome, "8", "chroma", "image_chroma")
    lora_loads_and_changes_sampling(comfy, client, "chroma", None, "image_chroma", steps=1)


def test_the_generic_presets_find_auraflows_attention_and_feed_forward_layers():
    """Issue 34: AuraFlow names its projections w1q..w2o and its feed-forward c_fc1/c_fc2/c_proj; the generic
    family's presets matched none of them ("the adapter preset selects no layers of this model")."""
    from types import SimpleNamespace
    bootstrap_comfy()
    import comfy.latent_formats
    import comfy.ops
    from comfy.ldm.aura.mmdit import MMDiT
    from ingraph_trainer.trainer.models.generic import GenericFamily
    with torch.device("meta"):
        model = MMDiT(dim=64, n_layers=2, n_double_layers=1, n_heads=2, global_conddim=64, cond_seq_dim=32,
                      max_seq=64, operations=comfy.ops.disable_weight_init)
    family = GenericFamily(SimpleNamespace(diffusion_model=model, model_config=type("AuraFlow", (), {})(),
                                           latent_format=comfy.latent_formats.SDXL()), "flow")
    attention = family.adapter_targets("attention")
    assert {n for n in attention if n.startswith("double_layers.0.")} == {
        f"double_layers.0.attn.w{stream}{p}" for stream in (1, 2) for p in "qkvo"}
    assert {n for n in attention if n.startswith("single_layers.0.")} == {
        f"single_layers.0.attn.w1{p}" for p in "qkvo"}
    feed_forward = set(family.adapter_targets("attention_ff")) - set(attention)
    assert {"double_layers.0.mlpX.c_fc1", "double_layers.0.mlpX.c_proj", "single_layers.0.mlp.c_fc2"} <= feed_forward


def test_the_generic_attention_preset_finds_kandinsky5s_projections():
    """Kandinsky 5 names its attention projections to_query/to_key/to_value/out_layer and its feed-forward layers
    in_layer/out_layer (issue 34)."""
    import re
    from ingraph_trainer.trainer.models.generic import ATTENTION, FEED_FORWARD
    names = [f"visual_transformer_blocks.0.{a}.{p}" for a in ("self_attention", "cross_attention")
             for p in ("to_query", "to_key", "to_value", "out_layer")]
    assert all(any(re.search(p, n) for p in ATTENTION) for n in names)
    assert not any(re.search(p, "visual_transformer_blocks.0.feed_forward.in_layer") for p in ATTENTION)
    assert all(any(re.search(p, f"visual_transformer_blocks.0.feed_forward.{n}") for p in FEED_FORWARD)
               for n in ("in_layer", "out_layer"))


def test_the_generic_family_trains_models_built_of_comfyuis_flux_blocks():
    """LongCat-Image and HunyuanImage 2.1 are built of ComfyUI's Flux blocks, which add residuals in place, and no
    Flux-layout family takes them: the generic family makes those adds out of place, as the flux family does (a tiny
    Flux stands in for them here: the blocks are the same classes)."""
    from ingraph_trainer.trainer.models import Batch
    from ingraph_trainer.trainer.models.generic import GenericFamily
    family = GenericFamily(narrow_flux_model(guidance_embed=False), "flow")
    family.prepare_for_training()
    modules = dict(family.diffusion_model.named_modules())
    targets = [t for t in family.adapter_targets("all_linear") if "_blocks." in t]  # every block's linear layers
    assert any(".img_attn.qkv" in t for t in targets) and any("single_blocks" in t for t in targets)
    for t in targets:
        modules[t].weight.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    context = family.diffusion_model.params.context_in_dim
    pooled = family.diffusion_model.params.vec_in_dim
    batch = Batch(torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 8, context, generator=g),
                  torch.randn(2, pooled, generator=g), torch.randn(2, 16, 8, 8, generator=g), torch.tensor([0.3, 0.8]))
    family.loss(batch).backward()
    assert all(modules[t].weight.grad is not None and modules[t].weight.grad.abs().sum() > 0 for t in targets)


def test_longcat_image_trains_with_the_rope_shift_its_comfyui_model_applies():
    """LongCat-Image (ComfyUI 0.33, the generic family): ComfyUI's _apply_model shifts the rotary positions by the
    text's length; the family's loss is ComfyUI's sampler's with that shift (without it the positions differ)."""
    bootstrap_comfy()
    import comfy.model_base
    import comfy.sd
    from ingraph_trainer.trainer.models import family_for
    from tools.family_coverage import CLASS_BUILT, class_state_dict
    if not hasattr(comfy.model_base, "LongCatImage"):
        pytest.skip("skipped: this ComfyUI has no LongCatImage (0.33 and later have)")
    torch.manual_seed(0)
    patcher = comfy.sd.load_diffusion_model_state_dict(class_state_dict("LongCatImage", *CLASS_BUILT["LongCatImage"]),
                                                       model_options={"dtype": torch.float32})
    family = family_for(patcher.model, patcher=patcher)
    assert family.name == "generic" and type(patcher.model).__name__ == "LongCatImage"
    batch = _batch((16, 8, 8), (8, 3584))
    expected = comfyui_losses(family, batch, {})
    family.prepare_for_training()
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)


def _class_built(class_name: str):
    """ComfyUI's MODEL of tools/family_coverage.py's tiny model of the model class `class_name` of ComfyUI's list
    (skipped where this ComfyUI lacks the class: ComfyUI 0.33 has these)."""
    bootstrap_comfy()
    import comfy.sd
    import comfy.supported_models
    from tools.family_coverage import CLASS_BUILT, class_state_dict
    if class_name not in {c.__name__ for c in comfy.supported_models.models}:
        pytest.skip(f"skipped: this ComfyUI has no {class_name} (0.33 and later have)")
    torch.manual_seed(0)
    return comfy.sd.load_diffusion_model_state_dict(class_state_dict(class_name, *CLASS_BUILT[class_name]),
                                                    model_options={"dtype": torch.float32})


def test_joyimage_trains_its_joint_attention_through_comfy_kitchens_rotary_op():
    """JoyImage (ComfyUI 0.33, the generic family): its joint attention is one module holding each stream's layers
    (attn.img_attn_qkv, ...), which the attention preset selects; its forward runs comfy-kitchen's fused rms_rope in
    training too, which the trainer gives a backward (trainer/kitchen_autograd.py). The family's loss is ComfyUI's
    sampler's, and every selected layer gets a gradient."""
    from ingraph_trainer.trainer.models import family_for
    patcher = _class_built("JoyImage")
    family = family_for(patcher.model, patcher=patcher)
    assert family.name == "generic" and type(patcher.model).__name__ == "JoyImage"
    targets = family.adapter_targets("attention")
    assert {t.rsplit(".", 1)[1] for t in targets} == {"img_attn_qkv", "img_attn_proj", "txt_attn_qkv",
                                                       "txt_attn_proj"}, targets
    batch = _batch((16, 1, 8, 8), (8, 4096))
    expected = comfyui_losses(family, batch, {})
    family.prepare_for_training()
    modules = dict(family.diffusion_model.named_modules())
    for t in targets:
        modules[t].weight.requires_grad_(True)
    loss = family.loss(batch, reduce=False)
    assert torch.allclose(loss.detach(), expected, rtol=1e-6, atol=0), (loss, expected)
    loss.mean().backward()
    # the last block's text output is discarded (as in Flux's layout): its projection gets no gradient
    trained = [t for t in targets if t != "double_blocks.0.attn.txt_attn_proj"]
    assert len(trained) == 3 and all(modules[t].weight.grad.abs().sum() > 0 for t in trained)


def _tiny_anima_text_encoder():
    """ComfyUI 0.33's own Anima text encoder (its Qwen3 one layer deep, 1024 wide as the model reads it) and
    tokenizers: what CLIPLoader's "anima" type builds."""
    import comfy.sd
    import comfy.supported_models_base
    import comfy.text_encoders.anima
    config = {"hidden_size": 1024, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1}
    clip = comfy.sd.CLIP(comfy.supported_models_base.ClipTarget(comfy.text_encoders.anima.AnimaTokenizer,
                                                                 comfy.text_encoders.anima.te()),
                         model_options={"qwen3_06b_model_config": config})
    g = torch.Generator().manual_seed(0)
    for p in clip.cond_stage_model.parameters():  # ComfyUI's layers are built uninitialised
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return clip


class GlyphTextEncoder:
    """Stands in for HunyuanImage 2.1's text encoder (ComfyUI's HunyuanImageTEModel: Qwen2.5-VL 7B and ByT5, far too
    large here), as ComfyUI's CLIP wraps it: its cond_stage_model's class has the encoder's name, which is what the
    cache asks; a pseudo-random 3584-wide embedding per caption, and, as the encoder's tokenizer gives it (its rule:
    text in double quotes), a 1472-wide ByT5 glyph embedding of the quoted text's length for a quoted caption alone."""

    def __init__(self):
        self.cond_stage_model = type("HunyuanImageTEModel", (), {})()
        self.layer_idx = None

    def get_sd(self):
        return {"glyph_stand_in": torch.ones(1)}

    def tokenize(self, text):
        import re
        return {"text": text, "quoted": "".join(f'Text "{q}". ' for q in re.findall(r'"(.*?)"', text))}

    def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False):
        import hashlib

        def seeded(salt):
            digest = hashlib.sha256(f"{salt}|{tokens['text']}".encode()).digest()
            return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (2 ** 63))
        out = {"cond": torch.randn(1, 8, 3584, generator=seeded("cond")), "pooled_output": None}
        if tokens["quoted"]:
            out["conditioning_byt5small"] = torch.randn(1, len(tokens["quoted"]), 1472, generator=seeded("byt5"))
        return out


def test_hunyuan_image_trains_on_the_glyph_embedding_of_quoted_captions_as_comfyuis_sampler_reads_it(tmp_path):
    """HunyuanImage 2.1 (its glyph branch built, as ComfyUI detects it from byt5_in): its text encoder gives a caption
    with quoted text a ByT5 glyph embedding beside the embedding. Cache Text Embeddings keeps it for those captions
    alone; the family's loss on such a caption is ComfyUI's sampler's on CLIPTextEncode's conditioning of it (the
    model's txt_byt5), and another glyph embedding gives another loss. Captions with and without one do not batch,
    as ComfyUI would not batch them: refused at start for a batch size over 1, naming both, and at a step."""
    from ingraph_trainer.cache.encoding import TEXT_EXTRA
    from ingraph_trainer.trainer.data.batch_mix import training_batch
    from ingraph_trainer.trainer.data.dataset_checks import check_text_extras_batching, text_inputs_beside_the_embedding
    from ingraph_trainer.trainer.models import Batch, family_for
    from media_files import cached_captions
    from tools.family_coverage import CLASS_BUILT, class_state_dict
    bootstrap_comfy()
    import comfy.sd
    import comfy.supported_models
    if "HunyuanImage21" not in {c.__name__ for c in comfy.supported_models.models}:
        pytest.skip("skipped: this ComfyUI has no HunyuanImage21")
    torch.manual_seed(0)
    config, metadata = CLASS_BUILT["HunyuanImage21"]
    patcher = comfy.sd.load_diffusion_model_state_dict(class_state_dict("HunyuanImage21", {**config, "byt5": True},
                                                                        metadata),
                                                       model_options={"dtype": torch.float32})
    assert patcher.model.diffusion_model.byt5_in is not None
    family = family_for(patcher.model, patcher=patcher)
    assert family.name == "generic" and type(patcher.model).__name__ == "HunyuanImage21"
    captions = {"sign": 'a shop sign that says "OPEN"', "cat": "a cat on a mat"}
    _, cached, by_name = cached_captions(tmp_path, GlyphTextEncoder(), captions, latent_channels=64)
    sign, cat = cached.text(by_name["sign"]), cached.text(by_name["cat"])
    assert TEXT_EXTRA + "conditioning_byt5small" in sign and not any(k.startswith(TEXT_EXTRA) for k in cat)

    b = training_batch(cached, [by_name["sign"]])
    glyph = b.text_extras["conditioning_byt5small"]
    assert glyph.shape == (1, len('Text "OPEN". '), 1472)
    g = torch.Generator().manual_seed(1)
    batch = Batch(torch.randn(1, 64, 8, 8, generator=g), b.cond, None, torch.randn(1, 64, 8, 8, generator=g),
                  torch.tensor([0.6]), text_mask=b.text_mask, text_extras=b.text_extras)
    expected = comfyui_losses(family, batch, {"conditioning_byt5small": glyph})
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
        other = family.loss(Batch(**{**batch.__dict__, "text_extras": {"conditioning_byt5small": torch.randn(
            glyph.shape, generator=g)}}), reduce=False)  # (not its tokens reordered: text attention has no order)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)
    assert not torch.allclose(other, got), "the glyph embedding does not reach the model"

    # pipeline stages and distillation, which pass on no extras, see it though the first caption has none
    assert cached.sources[0].endswith("cat.png")
    assert text_inputs_beside_the_embedding(family, cached) == "conditioning_byt5small"
    check_text_extras_batching(cached, 1)
    # the manifest says the encoder keeps extras; one that says it keeps none has no caption read
    import dataclasses
    assert cached.keeps_text_extras is True
    check_text_extras_batching(dataclasses.replace(cached, keeps_text_extras=False), 2)
    with pytest.raises(ValueError, match=r"train.batch_size: the text encoder gave the captions other outputs beside "
                                         r"the embedding \(.*(sign|cat).png: .*; .*(sign|cat).png: .*\).*batch_size 1"):
        check_text_extras_batching(cached, 2)
    with pytest.raises(ValueError, match="train.batch_size: the text encoder gave conditioning_byt5small for some "
                                         "captions of this batch and not others"):
        training_batch(cached, [by_name["sign"], by_name["cat"]])


def test_anima_trains_on_each_captions_t5_token_ids_as_comfyuis_sampler_reads_them(tmp_path):
    """Anima (ComfyUI 0.33) reads its text through an LLM adapter fed each caption's T5 token ids and weights beside
    the Qwen3 embedding. Its text encoder returns them beside the embedding; Cache Text Embeddings keeps them (the
    encoder's identity says so, so entries cached before are not reused), the trainer's batches carry them, and the
    family's loss on a cached caption is ComfyUI's sampler's (inference mode, where its extra_conds runs the adapter)
    on CLIPTextEncode's conditioning of it. Without them a dataset is refused, naming them; captions of other token
    counts do not batch, as ComfyUI would not batch them, so a batch size over 1 is refused at queue time."""
    import ingraph_trainer.cache.encoding as encoding
    from ingraph_trainer.trainer.data.batch_mix import training_batch
    from ingraph_trainer.trainer.data.dataset_checks import check_dataset_for_family
    from ingraph_trainer.trainer.models import Batch, family_for
    from media_files import cached_captions
    patcher = _class_built("Anima")
    family = family_for(patcher.model, patcher=patcher)
    assert family.name == "generic" and family.text_extras_needed == ("t5xxl_ids", "t5xxl_weights")
    torch.manual_seed(0)
    clip = _tiny_anima_text_encoder()
    # the same number of Qwen3 tokens, not of T5 tokens (5 and 8, 5 and 7)
    captions = {"cat": "a cat on a mat", "dog": "an aardvark"}
    dataset, cached, by_name = cached_captions(tmp_path, clip, captions, latent_channels=16, video=True)
    check_dataset_for_family(cached, family)

    conditioning = clip.encode_from_tokens(clip.tokenize(captions["cat"]), return_dict=True)  # CLIPTextEncode's
    assert conditioning["t5xxl_ids"].dim() == 1 and len(conditioning["t5xxl_ids"]) > 1
    b = training_batch(cached, [by_name["cat"]])
    assert torch.equal(b.text_extras["t5xxl_ids"], conditioning["t5xxl_ids"][None])
    assert torch.equal(b.text_extras["t5xxl_weights"], conditioning["t5xxl_weights"][None])
    g = torch.Generator().manual_seed(1)
    batch = Batch(torch.randn(1, 16, 8, 8, generator=g), b.cond, None, torch.randn(1, 16, 8, 8, generator=g),
                  torch.tensor([0.6]), text_mask=b.text_mask, text_extras=b.text_extras)
    item = {k: v for k, v in conditioning.items() if k != "cond"}
    expected = comfyui_losses(family, batch, item, inference=True)
    family.prepare_for_training()
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)
    # the token ids reach the model: other ids, another loss
    other = b.text_extras.to("cpu")
    other["t5xxl_ids"] = (other["t5xxl_ids"] + 1) % 32000
    with torch.no_grad():
        assert not torch.allclose(family.loss(Batch(**{**batch.__dict__, "text_extras": other}), reduce=False), got)
    # captions of other T5 token counts: ComfyUI conditions them one at a time, so a batch of several is refused at
    # queue time (the node's check, and the trainer's), and a batch that reached a step anyway fails naming it
    from ingraph_trainer.runner.train_run import check_dataset_for_model, check_family_settings
    from ingraph_trainer.trainer.graph_model import GraphModel
    from ingraph_trainer.trainer.spec import AdapterSpec, TrainSpec
    with pytest.raises(ValueError, match=r"^Train LoRA \(generic \(Anima\) model\): train.batch_size: Anima's "
                                         r"captions each have their own number of T5 tokens"):
        check_family_settings(GraphModel(patcher), TrainSpec(batch_size=2), AdapterSpec(), "comfyui")
    check_family_settings(GraphModel(patcher), TrainSpec(batch_size=1), AdapterSpec(), "comfyui")
    # the graph's dataset: its captions are the trainer's to check
    check_dataset_for_model(GraphModel(patcher), dataset, "Evaluate")
    with pytest.raises(ValueError, match=r"train.batch_size: the text encoder's t5xxl_ids has a different shape"):
        training_batch(cached, [by_name["cat"], by_name["dog"]])
    # entries cached before the extras were kept are not reused: the encoder's identity says it returns them
    assert encoding.returns_text_extras(clip)
    identity = encoding.clip_identity(clip)
    original = encoding.returns_text_extras
    encoding.returns_text_extras = lambda clip: False
    try:
        assert encoding.clip_identity(clip) != identity
    finally:
        encoding.returns_text_extras = original

    class WithoutExtras:  # captions another text encoder cached: no token ids
        def __len__(self):
            return 1

        def text(self, i):
            return {"cond": b.cond[0]}
        reference_slots = 0
    with pytest.raises(ValueError, match=r"data.manifest: generic \(Anima\) is conditioned on its text encoder's "
                                         r"t5xxl_ids, t5xxl_weights beside the embedding, which the cached captions"):
        check_dataset_for_family(WithoutExtras(), family)


@pytest.mark.parametrize("class_name", ["HunyuanDiT", "HunyuanDiT1"])
def test_hunyuan_dit_trains_on_both_its_text_encoders_as_comfyuis_sampler_reads_them(class_name):
    """HunyuanDiT (the generic family) reads two text encoders: its Chinese CLIP's embedding and attention mask, and
    the mT5 embedding and its mask that ComfyUI's HunyuanDiT text encoder returns beside them (the text cache keeps
    them: Batch.text_mask and Batch.text_extras). With the image size the sampler gives extra_conds, the family's loss
    is ComfyUI's sampler's on that conditioning, item by item (HunyuanDiT 1.0 reads the size too); the mT5 embedding
    reaches the model."""
    from ingraph_trainer.trainer.models import Batch, family_for
    from tools.family_coverage import random_batch
    patcher = _class_built(class_name)
    family = family_for(patcher.model, patcher=patcher)
    assert family.name == "generic" and family.reads_text_mask
    assert family.text_extras_needed == ("conditioning_mt5xl", "attention_mask_mt5xl")
    batch = random_batch(family, f"tiny {class_name}", (2, 4, 8, 8), torch.Generator().manual_seed(0))
    assert batch.text_mask.shape == (2, 77) and 0 < batch.text_mask.sum() < batch.text_mask.numel()

    def conditioning(i):  # what CLIPTextEncode puts beside item i's embedding
        return {"attention_mask": batch.text_mask[i:i + 1],
                **{name: value[i:i + 1] for name, value in batch.text_extras.items()}}
    expected = comfyui_losses(family, batch, conditioning)
    family.prepare_for_training()
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
        assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)
        other = type(batch.text_extras)(batch.text_extras, conditioning_mt5xl=batch.text_extras["conditioning_mt5xl"] + 1)
        assert not torch.allclose(family.loss(Batch(**{**batch.__dict__, "text_extras": other}), reduce=False), got)


def test_boogu_trains_with_the_token_count_its_comfyui_model_takes_from_the_text_mask():
    """Boogu (ComfyUI 0.33, the generic family; Omnigen2's conditioning): its forward needs num_tokens, which its
    extra_conds makes from the text encoder's attention mask; the family gives the cached embedding's all-ones mask,
    and its loss is ComfyUI's sampler's with that mask (without it the model cannot run)."""
    from ingraph_trainer.trainer.models import family_for
    patcher = _class_built("Boogu")
    family = family_for(patcher.model, patcher=patcher)
    assert family.name == "generic" and type(patcher.model).__name__ == "Boogu"
    text_width = patcher.model.diffusion_model.state_dict()["time_caption_embed.caption_embedder.1.weight"].shape[1]
    batch = _batch((16, 8, 8), (8, text_width))
    expected = comfyui_losses(family, batch, {"attention_mask": torch.ones(1, 8, dtype=torch.long)})
    family.prepare_for_training()
    with torch.no_grad():
        got = family.loss(batch, reduce=False)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)
