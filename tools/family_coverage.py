"""Which of ComfyUI's own model classes this pack can build and train today (issue 34's coverage run, first part).

Walks the installed ComfyUI's `comfy.supported_models.models`. For each family file's tiny random-weight model (and
its variants: Wan's image-to-video ones, the embedded SD1.5), it asks ComfyUI's own detection which class that state
dict is (`model_detection.model_config_from_unet`), loads it with ComfyUI's loader, and asks the trainer which family
takes the loaded model; with --train, each such model is also trained 2 LoRA steps by the trainer program, handed
the model as a file and a cache of random latents and text of the family's shapes (tools/coverage_runs.py), and the
adapter file it writes is loaded with ComfyUI's LoRA loader onto a fresh copy of the model (lora_in_comfyui).
Every class no builder here reaches is listed with what kind of model it is (its latent format), so the table says
what is covered and what is not yet.

    python tools/family_coverage.py [--train] [--markdown coverage.md] [--json coverage.json] [--readme README.md]
    COMFYUI_PATH=/opt/ComfyUI-0.33 PYTHONPATH=$PWD/.venv/comfyui-0.33 python tools/family_coverage.py

The last line is the count: classes in ComfyUI's list, image/video diffusion classes among them, and how many of
those a tiny model here is detected as (and trains, with --train). --readme rewrites that ComfyUI version's part of
the README's coverage section (between its `family-coverage` markers) from the same rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.prepare_run import _bootstrap  # noqa: E402

# builder label -> (family class name, scratch sizes) beyond each family's own "tiny" size
VARIANTS = {
    "wan i2v_2.1": ("WanFamily", dict(dim=128, ffn_dim=256, num_layers=1, variant="i2v_2.1")),
    "wan i2v_2.2": ("WanFamily", dict(dim=128, ffn_dim=256, num_layers=1, variant="i2v_2.2")),
    "wan ti2v_5b": ("WanFamily", dict(dim=128, ffn_dim=256, num_layers=1, variant="ti2v_5b")),
    "lumina2 z_image": ("Lumina2Family", dict(n_layers=1, variant="z_image")),  # ComfyUI 0.33's Z-Image
    "hunyuan_video i2v": ("HunyuanVideoFamily", dict(in_channels=33)),  # the start image's latent and a mask
    "hunyuan_video skyreels i2v": ("HunyuanVideoFamily", dict(in_channels=32, guidance_embed=False)),
    "flux schnell": ("FluxFamily", dict(depth=1, depth_single_blocks=0, vec_in_dim=64, guidance_embed=False)),
    # SDXL's own classes are told apart by their transformer depths (ComfyUI's unet_config): each at width 320
    "sdxl (SDXL's depths)": ("SDXLFamily", dict(num_res_blocks=(2, 2, 2), transformer_depth=(0, 0, 2, 2, 10, 10))),
    "sdxl (SSD-1B's depths)": ("SDXLFamily", dict(num_res_blocks=(2, 2, 2), transformer_depth=(0, 0, 2, 2, 4, 4))),
    "sdxl (Vega's depths)": ("SDXLFamily", dict(num_res_blocks=(2, 2, 2), transformer_depth=(0, 0, 1, 1, 2, 2))),
    "sdxl (KOALA-1B's depths)": ("SDXLFamily", dict(transformer_depth=(0, 2, 6))),
}
TEXT_OF_BUILDER = {"lumina2 z_image": (8, 2560, None),  # Qwen3-4B's width
                   "sd_unet (tiny SD2)": (8, 1024, None),  # OpenCLIP-H's
                   "generic (SD2.1 unCLIP-L)": (8, 1024, None), "generic (SD2.1 unCLIP-H)": (8, 1024, None),
                   "generic (SDXL refiner)": (8, 1280, 1280),  # OpenCLIP-G alone, its pooled vector too
                   "tiny CosmosT2IPredict2": (8, 1024, None), "tiny CosmosI2VPredict2": (8, 1024, None),
                   # its Chinese CLIP's, padded to the 77 tokens the model overwrites past the mask (its mT5's, 256
                   # tokens 2048 wide, are an extra: TEXT_EXTRAS_OF_BUILDER)
                   "tiny HunyuanDiT": (77, 1024, None), "tiny HunyuanDiT1": (77, 1024, None),
                   "tiny AuraFlow": (8, 2048, None),
                   "tiny LongCatImage": (8, 3584, None),  # Qwen2.5-VL-7B's
                   "tiny HunyuanImage21": (8, 3584, None),  # Qwen2.5-VL-7B's
                   "tiny Anima": (8, 1024, None),  # Qwen3-0.6B's
                   "tiny ZImagePixelSpace": (8, 2560, None),  # Z-Image's Qwen3-4B's
                   "tiny MageFlow": (8, 2560, None),  # Qwen3-VL-4B's
                   "tiny Ideogram4": (8, 13 * 4096, None),  # 13 of Qwen3-VL-8B's layers side by side
                   "tiny Lens": (8, 4 * 2880, None),  # GPT-OSS-20B's, 4 layers side by side
                   "tiny Kandinsky5": (8, 3584, 768), "tiny Kandinsky5Image": (8, 3584, 768),  # Qwen2.5-VL's, CLIP-L's
                   "hunyuan_video i2v": (8, 4096, 768), "hunyuan_video skyreels i2v": (8, 4096, 768)}  # Pile-T5-XL's
# what the text encoder returns beside the embedding (Batch.text_extras, as a batch of 2 stacks them): HunyuanDiT's
# mT5 embedding and both masks (half the tokens padding); Anima's T5 token ids and weights (its LLM adapter's input)
def _hunyuan_dit_extras(g):
    import torch
    mask = (torch.arange(256) < 128).long().repeat(2, 1)
    return {"conditioning_mt5xl": torch.randn(2, 256, 2048, generator=g), "attention_mask_mt5xl": mask}


def _anima_extras(g):
    import torch
    return {"t5xxl_ids": torch.randint(0, 32000, (2, 6), generator=g, dtype=torch.int32),
            "t5xxl_weights": torch.ones(2, 6)}


TEXT_EXTRAS_OF_BUILDER = {"tiny HunyuanDiT": _hunyuan_dit_extras, "tiny HunyuanDiT1": _hunyuan_dit_extras,
                          "tiny Anima": _anima_extras}
# text (tokens, width, pooled width or None) each family's tiny model takes in --train (its conditioning's shapes)
TEXT = {"sd_unet": (8, 768, None), "sdxl": (8, 2048, 1280), "sd3": (8, 64, 32), "flux": (8, 4096, 64),
        "wan": (8, 4096, None), "hunyuan_video": (8, 4096, 768), "ltxv": (8, 4096, None),
        "qwen_image": (8, 3584, None), "chroma": (8, 4096, None), "lumina2": (8, 2304, None),
        "flux2": (8, 64, None),  # the tiny Flux.2 reads 64-wide text (its txt_in; real ones: 7680 or 15360)
        "krea2": (8, 320, None),  # 2 encoder layers of 160 side by side (the real one: 12 of Qwen3-VL-4B)
        "hunyuan_video15": (8, 64, None),
        "ltxav": (8, 32, None),  # the tiny LTX-2's text: its connectors' width (real ones: 3840, Gemma 3 projected)
        "minimax_h3": (8, 32, None)}  # the tiny MiniMax H3's condition_proj input (the real one: Qwen3-VL-32B's 5120)
# the audio latent (channels, stereo, time) a joint audio-video model's tiny one trains on beside its video (MiniMax
# H3's audio VAE: 32 channels, stereo, 40 latents a second; 5: an eighth of a second); and the video latent's
# channels where the latent format names another width (MiniMax H3's names the larger of its two streams', 32)
AUDIO_OF_CLASS = {"MiniMaxH3": (32, 2, 5)}
VIDEO_CHANNELS_OF_CLASS = {"MiniMaxH3": 24}


# ComfyUI class -> why no tiny model here trains it (for a class that trains: what the training leaves out)
COSMOS_FLOW = ("trains on Cosmos Predict2's objective, ComfyUI's COSMOS_RFLOW (rectified flow, each flow time named by "
               "its EDM sigma t / (1 - t)); ComfyUI 0.3.64 fixes its depth (28 or 36 blocks), so there the tiny one "
               "does not load whole")
COGVIDEOX_DDPM = ("trains on CogVideoX's objective, ComfyUI's V_PREDICTION_DDPM (v on the unscaled noisy latent: the "
                  "trainer's v_prediction_ddpm)")
NO_EXTRA = "trains as ComfyUI runs it without its {} (ComfyUI leaves them out or zero); the trainer gives none"
WHY_NOT = {
    # trained, with what the training leaves out
    "SD15_instructpix2pix": "trains with ComfyUI's zeros for the image to edit (the trainer gives no edit pairs)",
    "SDXL_instructpix2pix": "trains with ComfyUI's zeros for the image to edit (the trainer gives no edit pairs)",
    "SD21UnclipL": NO_EXTRA.format("CLIP-vision image embedding"),
    "SD21UnclipH": NO_EXTRA.format("CLIP-vision image embedding"),
    "SDXLRefiner": "generic family: ComfyUI's default aesthetic score (6); the sizes the latent's, as the sampler "
                   "gives them",
    "WAN21_FunControl2V": NO_EXTRA.format("control video and start image"),
    "WAN21_Camera": NO_EXTRA.format("camera poses"), "WAN22_Camera": NO_EXTRA.format("camera poses"),
    "WAN21_Vace": NO_EXTRA.format("VACE control frames and mask"),
    "WAN21_HuMo": NO_EXTRA.format("audio embedding and reference images"),
    "WAN22_S2V": NO_EXTRA.format("audio, reference image, motion and pose inputs"),
    "WAN22_Animate": NO_EXTRA.format("face video and pose latents"),
    "WAN_Animate2": NO_EXTRA.format("pose video and reference inputs"),
    "WAN21_SCAIL": NO_EXTRA.format("pose and reference latents"),
    "WAN21_SCAIL2": NO_EXTRA.format("pose, reference and identity-mask latents"),
    "WAN22_WanDancer": NO_EXTRA.format("audio and reference-image inputs"),
    "WAN21_FlowRVS": "referring video segmentation, not text-to-video: ComfyUI's IMG_TO_IMG_FLOW flows from a "
                     "clip's latent to its object mask's, so training needs a mask for each clip, which the trainer "
                     "does not take (the trainer refuses its objective)",
    "WAN21_CausalAR_T2V": "generic family, trained as a whole clip (not causally, frame block by block)",
    "HunyuanVideoI2V": NO_EXTRA.format("start image's latent and mask"),
    "HunyuanVideoSkyreelsI2V": NO_EXTRA.format("start image's latent"),
    "MageFlow": "generic family, with the timestep in float32 (ComfyUI's process_timestep rounds it to bf16; the "
                "trainer calls the diffusion model directly)",
    "Kandinsky5": NO_EXTRA.format("start image and its mask"),
    "LongCatImage": "generic family (its Flux blocks' residuals made out of place, its text-length rope shift as its "
                    "_apply_model adds it)",
    "HunyuanImage21": "generic family (its Flux blocks' residuals made out of place); a caption with quoted text "
                      "trains with the ByT5 glyph embedding its encoder gives it (test_image_families.py); its "
                      "step-distilled (mean-flow) release is refused, naming the model (its forward reads the "
                      "sampler's step schedule)",
    "HunyuanDiT": "generic family, on its Chinese CLIP's embedding and mask and its mT5 embedding and mask (the text "
                  "cache keeps the encoder's extra outputs, as CLIPTextEncode puts them into the conditioning)",
    "HunyuanDiT1": "generic family, on its Chinese CLIP's embedding and mask and its mT5 embedding and mask (the text "
                   "cache keeps the encoder's extra outputs, as CLIPTextEncode puts them into the conditioning)",
    "FluxInpaint": "trains with ComfyUI's defaults for the inpaint image and mask (the flux family gives none); "
                   "trained on ComfyUI 0.33 only (0.3.64 detects the tiny file as FluxInpaint but builds its "
                   "model another shape)",
    "CosmosT2IPredict2": COSMOS_FLOW,
    "CosmosI2VPredict2": COSMOS_FLOW,
    "CogVideoX_T2V": COGVIDEOX_DDPM,
    "CogVideoX_I2V": COGVIDEOX_DDPM + "; " + NO_EXTRA.format("start image"),
    "CogVideoX_Inpaint": COGVIDEOX_DDPM + "; " + NO_EXTRA.format("inpaint video and mask"),
    "JoyImage": "its attention runs comfy-kitchen's fused rms_rope, which has no backward: the trainer gives it the "
                "backward of comfy-kitchen's own eager implementation (trainer/kitchen_autograd.py)",
    "Boogu": "its forward needs num_tokens, which its extra_conds makes from the text's attention mask: the generic "
             "family gives the cached embedding's, all ones (as the Lumina 2 family does)",
    "Anima": "generic family: its LLM adapter reads each caption's T5 token ids and weights beside the Qwen3 "
             "embedding (the text cache keeps the encoder's extra outputs), given to the model as its extra_conds "
             "gives them in training; batch size 1 (each caption has its own number of T5 tokens)",
    # not built here
    "HiDream": "ComfyUI fixes the size (16 double and 32 single MoE blocks, 2560 wide: ~17B parameters)",
    "Omnigen2": "ComfyUI fixes the size (32 layers, 2520 wide: ~4B parameters)",
    "GenmoMochi": "ComfyUI fixes the size (48 blocks, 3072 wide: ~10B parameters)",
    "CosmosT2V": "ComfyUI fixes the depth (28 or 36 blocks at 4096 or 5120 wide: 7B or 14B) and the objective is "
                 "EDM", "CosmosI2V": "ComfyUI fixes the depth (28 or 36 blocks at 4096 or 5120 wide: 7B or 14B) "
                                     "and the objective is EDM",
    "SeedVR2": "video restoration (upscaler), detected only at its released 3B and 7B depths",
    "HiDreamO1": "ComfyUI reads no size from the weights: only the released model loads (a pixel-space model, "
                 "which would train on the \"pixel_space\" VAE's images as Chroma Radiance does)",
    "PixelDiTT2I": "ComfyUI reads no size from the weights: only the released model loads (a pixel-space model, "
                   "which would train on the \"pixel_space\" VAE's images as Chroma Radiance does)",
    "PiD": "pixel diffusion decoder: turns another model's latents into pixels, not text-to-image",
    "SD_X4Upscaler": "upscaler, not text-to-image (needs the low-resolution image and noise level)",
    "HunyuanImage21Refiner": "refiner of HunyuanImage 2.1's output (image-to-image), not built here",
    "HunyuanVideo15_SR_Distilled": "super-resolution of HunyuanVideo 1.5's output, not text-to-video",
    "LotusD": "depth/normal estimator (ComfyUI's IMG_TO_IMG), not text-to-image",
    "Stable_Zero123": "novel-view model: needs the input view and camera angles, which the trainer does not give",
    "SVD_img2vid": "image-to-video without text: needs the start image and its CLIP-vision embedding, which the "
                   "trainer does not give",
    "LTXAV": "trained here on video alone, as ComfyUI samples it from a video latent (the presets then adapt the "
             "video stream's layers); a run on clips cached with its audio VAE trains the audio stream too "
             "(test_clip_audio.py, test_video_families.py)",
    "MiniMaxH3": "trains video and audio together on clips cached with its audio VAE, its audio carried on the video's "
                 "noise schedule as ComfyUI's FLOW_AV sampler carries it (trainer/models/minimax_h3.py); one sample "
                 "a model call, as ComfyUI runs it",
    "Stable_Cascade_B": "Stable Cascade stage B: ComfyUI knows only the released sizes; needs stage C's output",
    "Stable_Cascade_C": "Stable Cascade stage C: ComfyUI knows only the released sizes (1536 or 2048 wide)",
    "ErnieImage": "ComfyUI reads no size from the weights: only the released model loads",
}

OUT_OF_SCOPE = {"audio": "audio model: this pack trains image and video models",
                "3D": "3-D generator: this pack trains image and video models",
                "other": "not a diffusion model (no latents to denoise: detection, segmentation, depth)"}

VIDEO_FAMILIES = ("wan", "hunyuan_video", "hunyuan_video15", "ltxv", "ltxav", "minimax_h3")
# classes the latent format misnames: an image model on a video VAE's latents, 3-D generators with image-like ones
KINDS = {"Krea2": "image", "Trellis2": "3D", "TripoSplat": "3D"}


def kind_of(config_class) -> str:
    """image, video, audio or 3D, from the class's latent format (ComfyUI's own description of its latents) and,
    for image models on a video VAE's latents (Qwen-Image, Cosmos text-to-image), its name."""
    if config_class.__name__ in KINDS:
        return KINDS[config_class.__name__]
    latent = getattr(config_class, "latent_format", None)
    name = f"{config_class.__name__} {getattr(latent, '__name__', '')}".lower()
    dims = getattr(latent, "latent_dimensions", 2)
    if getattr(latent, "__name__", "") == "LatentFormat":  # the base class: no latents of its own to denoise
        return "other"
    if "3d" in name:
        return "3D"
    if "audio" in name or "acestep" in name or dims == 1:
        return "audio"
    if dims == 3 and not any(w in config_class.__name__ for w in ("Image", "T2I")):
        return "video"
    return "image"


def unet_state_dict(config: dict) -> dict:
    """Random weights of a ComfyUI UNet of this config."""
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    from ingraph_trainer.trainer.models.base import random_state_dict
    unet = UNetModel(**config, operations=comfy.ops.disable_weight_init)
    return random_state_dict(unet, 0)


def unet_variants() -> dict:
    """label -> UNet config of the SD and SDXL classes ComfyUI tells apart by text width, input channels, adm width
    or model width (supported_models' unet_config): the embedded SD1.5's and the SDXL scratch model's configs,
    changed there."""
    from ingraph_trainer.trainer.models.sdxl import sdxl_unet_config
    from tools.embedded_default import TINY_UNET_CONFIG
    sd2 = {**TINY_UNET_CONFIG, "context_dim": 1024, "use_linear_in_transformer": True}
    sdxl = sdxl_unet_config(transformer_depth=(0, 0, 2, 2, 10, 10), num_res_blocks=(2, 2, 2))
    return {
        "sd_unet (tiny SD2)": sd2,  # the embedded default's UNet with SD2's text width and linear projections: SD20
        # InstructPix2Pix: the edited image's latent joins the noisy one (8 input channels)
        "sd_unet (SD1.5 InstructPix2Pix)": {**TINY_UNET_CONFIG, "in_channels": 8},
        "sdxl (SDXL InstructPix2Pix)": {**sdxl, "in_channels": 8},
        # SD2.1 unCLIP: the CLIP-vision embedding (and its noise level) as the adm vector
        "generic (SD2.1 unCLIP-L)": {**sd2, "adm_in_channels": 1536, "num_classes": "sequential"},
        "generic (SD2.1 unCLIP-H)": {**sd2, "adm_in_channels": 2048, "num_classes": "sequential"},
        # the SDXL refiner: 384 wide, 4 levels of 2 blocks, transformers in the middle two, 1280-wide text
        "generic (SDXL refiner)": {**sdxl, "model_channels": 384, "channel_mult": [1, 1, 1, 1],
                                   "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [0, 0, 4, 4, 4, 4, 0, 0],
                                   "transformer_depth_output": [0] * 12, "context_dim": 1280,
                                   "adm_in_channels": 2560},
    }


# Wan 2.1's tiny size (the wan family's own), as a ComfyUI unet_config
WAN_TINY = dict(dim=128, ffn_dim=256, num_heads=1, num_layers=1, patch_size=(1, 2, 2), freq_dim=256,
                window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6, in_dim=16, out_dim=16)
# Cosmos Predict2 text-to-image at 256 wide, 1 block (ComfyUI reads width and depth from the weights; 16 heads,
# its default, below 2048 wide)
COSMOS2_TINY = dict(max_img_h=240, max_img_w=240, max_frames=128, in_channels=16, out_channels=16, patch_spatial=2,
                    patch_temporal=1, model_channels=256, num_heads=16, concat_padding_mask=True,
                    crossattn_emb_channels=1024, pos_emb_cls="rope3d", pos_emb_learnable=True,
                    pos_emb_interpolation="crop", min_fps=1, max_fps=30, use_adaln_lora=True, adaln_lora_dim=256,
                    num_blocks=1, extra_per_block_abs_pos_emb=False, rope_h_extrapolation_ratio=4.0,
                    rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0, extra_h_extrapolation_ratio=1.0,
                    extra_w_extrapolation_ratio=1.0, extra_t_extrapolation_ratio=1.0, rope_enable_fps_modulation=False)
# CogVideoX 1.0 at 128 wide, 1 block: ComfyUI fixes 64-wide heads (reads their count from the weights); rotary
# positions (a file with no learned position table)
COGVIDEOX_TINY = dict(num_attention_heads=2, attention_head_dim=64, time_embed_dim=128, num_layers=1,
                      use_rotary_positional_embeddings=True)
# MiniMax H3 at 48 wide (2 heads of 24: its rotary tables are 6 x rope_inv_freq_len wide), 1 block and 1 text
# refiner block, 32-wide text; ComfyUI reads every size from the weights
MINIMAX_H3_TINY = dict(hidden_size=48, num_layers=1, token_refiner_num_layers=1, num_attention_heads=2,
                       attention_head_dim=24, ffn_hidden_size=64, text_dim=32, timestep_input_dim=32,
                       time_embed_hidden_size=48, time_embed_dim=32, rope_inv_freq_len=4)
LTXAV_TINY = dict(num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, audio_num_attention_heads=2,
                  audio_attention_head_dim=4, audio_cross_attention_dim=8, caption_channels=32,
                  connector_num_attention_heads=2, connector_attention_head_dim=16, connector_num_layers=1,
                  num_layers=1)
# ComfyUI class -> (its unet_config at a tiny size, the file metadata it is told apart by or sized from, or None):
# built by ComfyUI's own get_model for that class, then detected from the weights like any other file. Classes a
# family file builds (and so the New Model node offers) are built there; these are the rest a family trains.
CLASS_BUILT = {
    "WAN21_FunControl2V": (dict(WAN_TINY, in_dim=48), None),  # the control video's 16 + 16 channels + the mask's
    "WAN21_Camera": (dict(WAN_TINY, in_dim=32), None),
    "WAN22_Camera": (dict(WAN_TINY, in_dim=36), None),
    "WAN21_Vace": (dict(WAN_TINY, vace_layers=1, vace_in_dim=96), None),
    "WAN21_HuMo": (WAN_TINY, None),
    # ComfyUI's loader builds its 12 audio injectors whatever the depth (only the first one's block exists here)
    "WAN22_S2V": (WAN_TINY, None),
    "WAN22_Animate": (dict(WAN_TINY, num_layers=5), None),  # a face adapter every 5 blocks: 5 to have one
    "WAN21_SCAIL": (WAN_TINY, None),
    "WAN21_SCAIL2": (WAN_TINY, None),
    "WAN22_WanDancer": (dict(WAN_TINY, in_dim=36), None),
    "FluxInpaint": (dict(image_model="flux", in_channels=96, out_channels=16, vec_in_dim=64, context_in_dim=4096,
                         hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1, depth_single_blocks=0,
                         axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True,
                         txt_ids_dims=[]), None),  # txt_ids_dims: ComfyUI 0.33's Flux (0.3.64's has none)
    # PixArt: ComfyUI fixes the width (1152, 16 heads); one block of it
    "PixArtAlpha": (dict(num_heads=16, patch_size=2, hidden_size=1152, in_channels=4, depth=1, micro_condition=True),
                    None),
    "PixArtSigma": (dict(num_heads=16, patch_size=2, hidden_size=1152, in_channels=4, depth=1,
                         micro_condition=False), None),
    "HunyuanDiT": (dict(depth=1, hidden_size=256), None),
    # HunyuanDiT 1.0's size and style inputs: detected by the extra embedder's 3968 inputs, which fixes 1408 wide
    "HunyuanDiT1": (dict(depth=1, hidden_size=1408, size_cond=True, use_style_cond=True), None),
    "CosmosT2IPredict2": (COSMOS2_TINY, None),
    "CosmosI2VPredict2": (dict(COSMOS2_TINY, in_channels=17, rope_h_extrapolation_ratio=3.0,
                               rope_w_extrapolation_ratio=3.0), None),
    # AuraFlow: ComfyUI reads no width from the weights (3072, its default); one double block and one single one
    # (a double block that is also the last layer is built with the final layer's 2-way modulation, which its own
    # forward cannot run: real AuraFlow ends in single blocks)
    "AuraFlow": (dict(n_double_layers=1, n_layers=2, max_seq=64), None),
    # told apart by the file's metadata alone (ComfyUI reads model_type from its "config")
    "WAN_Animate2": (WAN_TINY, {"config": '{"transformer": {"model_type": "animate2"}}'}),
    "WAN21_FlowRVS": (WAN_TINY, {"config": '{"transformer": {"model_type": "flow_rvs"}}'}),
    "WAN21_CausalAR_T2V": (WAN_TINY, {"config": '{"transformer": {"causal_ar": true}}'}),
    "CogVideoX_T2V": (COGVIDEOX_TINY, None),
    "CogVideoX_I2V": (dict(COGVIDEOX_TINY, in_channels=32), None),  # the start image's 16 channels join the latent's
    # the inpaint video's and its mask's latents join the noisy one's 16 channels
    "CogVideoX_Inpaint": (dict(COGVIDEOX_TINY, in_channels=48), None),
    # Kandinsky 5 video: 64-wide heads (ComfyUI's default axes) at 128 wide, 1 text and 1 visual block; its
    # 132 patch inputs are the noisy latent's 16, ComfyUI's zero image's 16 and the mask's 1, 2x2 each
    "Kandinsky5": (dict(model_dim=128, time_dim=64, ff_dim=256, visual_embed_dim=132, num_text_blocks=1,
                        num_visual_blocks=1), None),
    # Kandinsky 5 image: ComfyUI tells it apart by its width, so fixes it (2560, 128-wide heads); 1 block of each
    "Kandinsky5Image": (dict(model_dim=2560, time_dim=64, ff_dim=256, visual_embed_dim=64, num_text_blocks=1,
                             num_visual_blocks=1, axes_dims=(32, 48, 48), rope_scale_factor=(1.0, 1.0, 1.0)), None),
    # Lens: ComfyUI fixes 64-wide heads (reads their count): 2, 128 wide, 1 block; Flux.2's 128 latent channels in,
    # GPT-OSS's 4 layers of 2880 side by side as its text
    "Lens": (dict(in_channels=128, out_channels=32, num_layers=1, num_attention_heads=2, enc_hidden_dim=2880,
                  multi_layer_encoder_feature=True, selected_layer_index=(0, 1, 2, 3)), None),
    # Boogu: ComfyUI reads the width but fixes 28 heads (7 for keys and values) and 120-wide rope, so the width is
    # 3360 too; 1 double-stream block (what it is detected by) and no refiner or single-stream one
    "Boogu": (dict(hidden_size=3360, num_layers=0, num_double_stream_layers=1, num_refiner_layers=0), None),
    # LongCat-Image: Flux's layout with 3584-wide text, no pooled vector nor guidance; one 128-wide head (ComfyUI's
    # Flux heads are 128 wide), 1 double block
    "LongCatImage": (dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=None, context_in_dim=3584,
                          hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1, depth_single_blocks=0,
                          axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False,
                          txt_ids_dims=[1, 2]), None),
    # HunyuanImage 2.1: HunyuanVideo's layout on 2-D 64-channel latents, 1x1 patches, 3584-wide text, no pooled
    # vector; ComfyUI fixes 128-wide heads (reads their count): one, 1 double block (0.33's HunyuanVideo parameters)
    "HunyuanImage21": (dict(in_channels=64, out_channels=64, patch_size=[1, 1], vec_in_dim=None, axes_dim=[64, 64],
                            meanflow=False, context_in_dim=3584, hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1,
                            depth_single_blocks=0, theta=256, qkv_bias=True, byt5=False, guidance_embed=False,
                            use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False), None),
    # JoyImage: ComfyUI fixes 128-wide heads (its rope; reads their count) and 4096-wide text: one head, 1 block
    "JoyImage": (dict(in_channels=16, hidden_size=128, num_attention_heads=1, num_layers=1, patch_size=[1, 2, 2],
                      text_dim=4096), None),
    # Anima: Cosmos Predict2's tiny size; its LLM adapter's size is fixed (6 blocks at 1024 wide, ~130M parameters)
    "Anima": (COSMOS2_TINY, None),
    # Mage-Flow: ComfyUI reads only the depth (24 heads of 128: 3072 wide, Flux.2's 128 channels, 2560-wide text);
    # 1 block of it
    "MageFlow": (dict(num_layers=1), None),
    # Ideogram 4: ComfyUI reads only the depth and input channels (18 heads of 256: 4608 wide, 53248-wide text);
    # 1 layer of it on Flux.2's 128 channels (~0.5B parameters)
    "Ideogram4": (dict(in_channels=128, num_layers=1), None),
    # pixel-space models (3 RGB channels, no VAE: ComfyUI's "pixel_space" VAE hands the image over, scaled to -1..1)
    # at ComfyUI's fixed widths, 1 block, 16-pixel patches; on ComfyUI 0.33 each predicts the clean image, which its
    # model turns into a flow velocity ("__x0__"; ComfyUI 0.3.64's Chroma Radiance has no such key, nor the
    # sequential text positions, so class_state_dict leaves those out there)
    "ChromaRadiance": (dict(in_channels=3, out_channels=3, in_dim=64, out_dim=3072, hidden_dim=5120, n_layers=5,
                            context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=1,
                            depth_single_blocks=0, axes_dim=[16, 56, 56], theta=10000, patch_size=16, qkv_bias=True,
                            nerf_hidden_size=64, nerf_mlp_ratio=4, nerf_depth=4, nerf_max_freqs=8, nerf_tile_size=512,
                            nerf_final_head_type="conv", nerf_embedder_dtype=None, use_x0=True,
                            use_sequential_txt_ids=True, txt_ids_dims=[], vec_in_dim=None), None),
    "ZImagePixelSpace": (dict(dim=3840, cap_feat_dim=2560, n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48],
                              axes_lens=[1536, 512, 512], rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0,
                              z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32, patch_size=16,
                              in_channels=3, n_layers=1, qk_norm=True, decoder_hidden_size=64,
                              decoder_num_res_blocks=1, decoder_max_freqs=8, use_x0=True), None),
    # LTX-2: ComfyUI reads its sizes from the file's "config" metadata (Lightricks' files carry one), else fixes 32
    # heads and 2048-wide audio; 2 heads of 8 for video, 2 of 4 for audio, 32-wide text connectors, 1 block
    "LTXAV": (LTXAV_TINY, {"config": json.dumps({"transformer": LTXAV_TINY})}),
    "MiniMaxH3": (MINIMAX_H3_TINY, None),
}


def class_model(class_name: str, unet_config: dict):
    """ComfyUI's model (comfy.model_base) for `class_name` at `unet_config`, built by the class's own get_model in
    float32, its weights not initialised. A setting this ComfyUI's model does not take (a newer ComfyUI's) is left
    out."""
    import re

    import comfy.supported_models
    import torch
    cls = getattr(comfy.supported_models, class_name)
    unet_config = dict(unet_config)
    while True:
        config = cls({**cls.unet_config, **unet_config})
        config.set_inference_dtype(torch.float32, None)
        try:
            return config.get_model({})
        except TypeError as exc:
            unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
            if unknown is None or unknown.group(1) not in unet_config:
                raise
            del unet_config[unknown.group(1)]


def class_state_dict(class_name: str, unet_config: dict, metadata: dict | None):
    """Random weights of ComfyUI's model for `class_name` at `unet_config` (class_model): the state dict, or
    (state dict, file metadata) where the class is told apart by metadata."""
    import torch
    from ingraph_trainer.trainer.models.base import random_state_dict
    state = random_state_dict(class_model(class_name, unet_config).diffusion_model, 0)
    for key in [k for k in state if k.endswith("inv_freq")]:  # a rotary frequency buffer ComfyUI leaves empty
        # (MiniMax H3's), filled as the released files hold it: 1 / 10000^(2i / d) for each of its d / 2 pairs
        n = state[key].numel()
        state[key] = 1.0 / 10000.0 ** (torch.arange(n, dtype=torch.float32) / n)
    return (state, metadata) if metadata else state


def builders() -> list:
    """(label, a function building its state dict) of every tiny model this pack builds: each family file's, its
    variants, SD1.5's (the embedded default checkpoint)."""
    from ingraph_trainer.trainer.models import FAMILIES
    from ingraph_trainer.trainer.models.base import ModelFamily

    def sd15():
        from safetensors.torch import load_file
        from tools.embedded_default import build_checkpoint
        with tempfile.TemporaryDirectory() as tmp:
            path = build_checkpoint(Path(tmp) / "sd15.safetensors")
            prefix = "model.diffusion_model."
            return {k[len(prefix):]: v for k, v in load_file(str(path)).items() if k.startswith(prefix)}
    out = [("sd_unet (embedded SD1.5)", sd15)]
    out += [(label, lambda config=config: unet_state_dict(config)) for label, config in unet_variants().items()]
    for cls in FAMILIES:
        if cls.scratch_state_dict.__func__ is ModelFamily.scratch_state_dict.__func__:  # builds none (SD1.5: above)
            continue
        out.append((cls.name, lambda cls=cls: cls.scratch_state_dict(0, **cls.scratch_sizes.get("tiny", {}))))
    out += [(f"tiny {name}", lambda name=name, c=c, m=m: class_state_dict(name, c, m))
            for name, (c, m) in CLASS_BUILT.items()]
    by_name = {c.__name__: c for c in FAMILIES}
    for label, (cls_name, size) in VARIANTS.items():
        out.append((label, lambda c=by_name[cls_name], size=size: c.scratch_state_dict(0, **size)))
    return out


LORA_RANK, LORA_ALPHA = 2, 2.0


# ComfyUI class -> the latent side its tiny model trains at, where 8 cannot run: PixArt scales its position
# embedding by round(side / 64), which is 0 (a division by zero) below a 48-latent (384 px) image; the pixel-space
# classes' latent is the image, 32 px: 2x2 of their 16-pixel patches
LATENT_SIDE = {"PixArtAlpha": 64, "PixArtSigma": 64, "ChromaRadiance": 32, "ZImagePixelSpace": 32}


def latent_shape(family, kind: str, side: int = 8) -> tuple:
    """The latent batch a family's tiny model trains on: video models (a video family's, or the generic family on
    a video class) on 3 latent frames; everything else on image latents, one-frame videos where the model's VAE is a
    video VAE (Qwen-Image's, Krea 2's: ComfyUI's VAE gives an image [C, 1, H, W] there, and the trainer refuses an
    image VAE's latents for such a model)."""
    channels = VIDEO_CHANNELS_OF_CLASS.get(type(family.base_model.model_config).__name__,
                                           family.base_model.latent_format.latent_channels)
    video = family.name in VIDEO_FAMILIES or (family.name == "generic" and kind == "video")
    if video:
        return 2, channels, 3, 4, 8
    return (2, channels, 1, side, side) if family.latent_ndim == 5 else (2, channels, side, side)


def random_batch(family, builder: str, shape: tuple, generator):
    """Random latents, text of the family's shapes (its conditioning's), noise and timesteps (and audio latents
    where the class takes them: AUDIO_OF_CLASS)."""
    import torch
    from ingraph_trainer.trainer.models import Batch
    from ingraph_trainer.trainer.data.loading import TextExtras
    tokens, width, pooled = TEXT_OF_BUILDER.get(builder) or TEXT.get(family.name, (8, 4096, None))
    extras = TEXT_EXTRAS_OF_BUILDER.get(builder)
    text_mask = (torch.arange(tokens) < tokens // 2).long().repeat(2, 1) if builder in ("tiny HunyuanDiT",
                                                                                         "tiny HunyuanDiT1") else None
    batch = Batch(torch.randn(shape, generator=generator), torch.randn(2, tokens, width, generator=generator),
                  torch.randn(2, pooled, generator=generator) if pooled else None,
                  torch.randn(shape, generator=generator), torch.rand(2, generator=generator),
                  text_mask=text_mask, text_extras=TextExtras(extras(generator)) if extras else None)
    audio = AUDIO_OF_CLASS.get(type(family.base_model.model_config).__name__)
    if audio:
        batch.audio = torch.randn(2, *audio, generator=generator)
        batch.audio_noise = torch.randn(2, *audio, generator=generator)
    return batch


def load_model(state: dict, metadata: dict | None):
    """ComfyUI's MODEL of these weights, as Load Diffusion Model loads a file of them (float32), from copies: ComfyUI's
    loader may take the tensors over, and the LoRA check loads the same weights afresh."""
    import comfy.sd
    import torch
    state = {k: v.clone() for k, v in state.items()}
    extra = {"metadata": metadata} if metadata else {}  # ComfyUI 0.3.64 takes none (nor has the classes needing it)
    return comfy.sd.load_diffusion_model_state_dict(state, model_options={"dtype": torch.float32}, **extra)


def lora_in_comfyui(state: dict, metadata: dict | None, adapter: Path, family_name: str, builder: str,
                    shape: tuple) -> tuple[str, str]:
    """The adapter file the trainer program wrote, read as Load LoRA reads a file and applied by what
    LoraLoaderModelOnly runs (comfy.sd.load_lora_for_models) to
    a freshly loaded MODEL of the same weights: (loads, output changes), each "yes" or why not. Loads: no "lora key
    not loaded" in ComfyUI's log and a weight patch on every layer in the file. Output changes: the patched model's
    output on one input differs from the unpatched one's by more than a rerun of the unpatched one does."""
    import logging

    import comfy.sd
    import comfy.utils
    import torch
    from ingraph_trainer.trainer import export
    from ingraph_trainer.trainer.models import family_for
    lora = comfy.utils.load_torch_file(str(adapter), safe_load=True)
    fresh = load_model(state, metadata)
    messages = []
    catcher = logging.Handler(logging.WARNING)
    catcher.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger().addHandler(catcher)
    try:
        patched = comfy.sd.load_lora_for_models(fresh, None, lora, 1.0, 0.0)[0]
    finally:
        logging.getLogger().removeHandler(catcher)
    missed = [m for m in messages if "lora key not loaded" in m]
    layers = {export.split_key(k)[0] for k in lora}
    if missed:
        loads = f"no: {len(missed)} keys not loaded ({missed[0][:80]})"
    elif len(patched.patches) != len(layers):
        loads = f"no: {len(patched.patches)} of the file's {len(layers)} layers patched"
    else:
        loads = "yes"
    family = family_for(fresh.model, family=family_name, patcher=fresh)
    family.compute_dtype = torch.float32
    batch = random_batch(family, builder, shape, torch.Generator().manual_seed(2))
    with torch.no_grad():
        before, rerun = family.model_output(batch), family.model_output(batch)
        patched.patch_model()
        try:
            after = family.model_output(batch)
        finally:
            patched.unpatch_model()
    change, noise = float((after - before).abs().max()), float((rerun - before).abs().max())
    scale = float(before.abs().max()) or 1.0
    changes = f"yes ({change / scale:.0e})" if change > max(noise * 10, 1e-7 * scale) else \
        f"no: max change {change:.1e} (rerun {noise:.1e})"
    return loads, changes


README_BEGIN = "<!-- family-coverage: ComfyUI {version} (written by tools/family_coverage.py --train --readme) -->"
README_END = "<!-- end family-coverage: ComfyUI {version} -->"


def readme_section(version: str, summary: str, rows: list[dict], full_table: str) -> str:
    """The README's part for one ComfyUI: the count, the classes trained (with the family that trains each), and
    what is left, by kind, pointing at the full table."""
    trained = [r for r in rows if "yes" in r["trained"]]
    left = [r for r in rows if r["kind"] in ("image", "video") and "yes" not in r["trained"]]
    lines = [README_BEGIN.format(version=version), f"**{summary}**", "",
             "| ComfyUI class | kind | family | tiny model here |", "|---|---|---|---|"]
    lines += [f"| {r['class']} | {r['kind']} | {', '.join(r['family'])} | {', '.join(r['builders'])} |"
              for r in sorted(trained, key=lambda r: (r["kind"], r["class"]))]
    lines += ["", f"Not trained ({len(left)} image or video classes): " + ", ".join(r["class"] for r in left)
              + f". Why not, for each, and every class, audio, 3-D and other models included: "
                f"[{full_table}]({full_table}).",
              README_END.format(version=version)]
    return "\n".join(lines)


def replace_readme_section(readme: Path, version: str, section: str) -> None:
    """Puts `section` between this version's markers in the README (refused where the markers are missing)."""
    text = readme.read_text(encoding="utf-8")
    begin, end = README_BEGIN.format(version=version), README_END.format(version=version)
    if begin not in text or end not in text:
        raise SystemExit(f"{readme}: no family-coverage markers for ComfyUI {version}; add\n{begin}\n{end}")
    head, rest = text.split(begin, 1)
    readme.write_text(head + section + rest.split(end, 1)[1], encoding="utf-8")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", action="store_true", help="2 LoRA steps on each model detected")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--readme", type=Path, help="rewrite this ComfyUI version's coverage section of this README "
                                                    "(with --markdown: the full table it links to)")
    parser.add_argument("--only", help="only the builder of this label, or those whose label contains it (a quick "
                                            "look; the tables of a partial run are partial)")
    opts = parser.parse_args(argv)
    _bootstrap()
    import comfy.model_detection
    import comfy.sd
    import comfy.supported_models
    import torch
    from ingraph_trainer.trainer.comfy_compat import comfyui_version
    from ingraph_trainer.trainer.models import family_for
    from tools.comfy_server import comfyui_path
    from tools.coverage_runs import train_with_program
    version = ".".join(map(str, comfyui_version(comfyui_path()))) or "?"
    classes = list(comfy.supported_models.models)
    reached = {}  # class name -> list of (builder, family, trained)
    walk = builders()
    if opts.only:  # a label exactly, else every label holding it
        walk = [b for b in walk if b[0] == opts.only] or [b for b in walk if opts.only in b[0]]
    for label, build in walk:
        began = time.perf_counter()
        try:
            torch.manual_seed(0)
            state = build()
            state, metadata = state if isinstance(state, tuple) else (state, None)
        except Exception as exc:  # noqa: BLE001 - a variant this ComfyUI's model classes cannot build
            print(f"{label}: not built on this ComfyUI ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
            continue
        config = comfy.model_detection.model_config_from_unet(state, "", metadata=metadata)
        if config is None:
            print(f"{label}: ComfyUI detects no class", flush=True)
            continue
        name = type(config).__name__
        try:
            patcher = load_model(state, metadata)
        except Exception as exc:  # noqa: BLE001 - detected, but ComfyUI's loader builds another shape
            print(f"{label}: detected as {name}, not loaded ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
            continue
        loads = changes = "not tried"
        uninitialised = sorted(set(patcher.model.diffusion_model.state_dict()) - set(state))
        if uninitialised:  # ComfyUI builds another size than the file's: what it does not load is random memory
            reached.setdefault(name, []).append({
                "builder": label, "family": "none", "loads": loads, "changes": changes,
                "trained": f"no: ComfyUI's loader builds another size: it leaves {len(uninitialised)} weights "
                           f"uninitialised ({uninitialised[0]}, ...)"})
            print(f"{label}: detected as {name}, loaded in part ({len(uninitialised)} weights missing)", flush=True)
            continue
        try:
            family = family_for(patcher.model, patcher=patcher)
        except ValueError as exc:  # an objective no family trains (Cosmos's EDM, ...)
            reached.setdefault(name, []).append({"builder": label, "family": "none", "trained": f"no: {exc}",
                                                 "loads": loads, "changes": changes})
            print(f"{label}: detected as {name}, no family takes it ({exc})", flush=True)
            continue
        shape = latent_shape(family, kind_of(type(config)), LATENT_SIDE.get(name, 8))
        trained, step_s = "not tried", None
        if opts.train:
            with tempfile.TemporaryDirectory(prefix="ingraph-coverage-") as tmp:
                try:
                    batch = random_batch(family, label, shape, torch.Generator().manual_seed(1))
                    run = train_with_program(patcher, state, metadata, batch, Path(tmp), label, LORA_RANK, LORA_ALPHA)
                    trained, step_s = run.trained, run.step_s
                except Exception as exc:  # noqa: BLE001 - the table says why, the walk goes on
                    trained = f"no: {type(exc).__name__}: {str(exc)[:120]}"
                    if opts.only:
                        import traceback
                        traceback.print_exc()
                if trained == "yes":
                    try:
                        loads, changes = lora_in_comfyui(state, metadata, run.adapter, family.name, label, shape)
                    except Exception as exc:  # noqa: BLE001
                        loads = changes = f"no: {type(exc).__name__}: {str(exc)[:120]}"
        reached.setdefault(name, []).append({"builder": label, "family": family.name, "trained": trained,
                                             "loads": loads, "changes": changes, "step_s": step_s})
        print(f"{label}: detected as {name}, family {family.name}, trained {trained}, LoRA loads {loads}, "
              f"output changes {changes} ({time.perf_counter() - began:.1f} s)", flush=True)
        del patcher, family, state
    rows = []
    for cls in classes:
        hits = reached.get(cls.__name__, [])
        rows.append({"class": cls.__name__, "kind": kind_of(cls),
                     "latent_format": getattr(getattr(cls, "latent_format", None), "__name__", "?"),
                     "builders": [h["builder"] for h in hits], "family": sorted({h["family"] for h in hits}),
                     "trained": [h["trained"] for h in hits], "loads": [h["loads"] for h in hits],
                     "changes": [h["changes"] for h in hits],
                     "step_s": [h["step_s"] for h in hits if h.get("step_s") is not None],
                     "why": WHY_NOT.get(cls.__name__, "")})
    diffusion = [r for r in rows if r["kind"] in ("image", "video")]  # audio, 3D and other: out of this pack's scope
    covered = [r for r in diffusion if r["builders"]]
    trained = [r for r in covered if "yes" in r["trained"]]
    loading = [r for r in trained if "yes" in r["loads"]]
    changing = [r for r in trained if any(c.startswith("yes") for c in r["changes"])]
    lines = [f"ComfyUI {version}: {len(rows)} model classes; {len(diffusion)} image or video diffusion classes, "
             f"{len(covered)} of them built here as a tiny model ComfyUI detects as that class"
             + (f", {len(trained)} trained 2 steps, whose LoRA loads in ComfyUI for {len(loading)} and changes "
                f"the output for {len(changing)}" if opts.train else "") + ".", "",
             "| ComfyUI class | kind | latent format | tiny model here | family | 2 LoRA steps (trainer program) "
             "| s/step | LoRA loads | output changes | why not / note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["kind"] not in ("image", "video"), not r["builders"], r["class"])):
        cells = [r["class"], r["kind"], r["latent_format"], ", ".join(r["builders"]) or "not built",
                 ", ".join(r["family"]), ", ".join(sorted(set(r["trained"]))),
                 ", ".join(f"{s:.2f}" for s in r["step_s"]),
                 *(", ".join(sorted(set(r[k]))) for k in ("loads", "changes")),
                 r["why"] or ("" if "yes" in r["trained"] else OUT_OF_SCOPE.get(r["kind"], "no reason recorded yet"))]
        lines.append("| " + " | ".join(" ".join(c.replace("|", "/").split()) for c in cells) + " |")  # one cell each
    table = "\n".join(lines)
    if opts.markdown:
        opts.markdown.write_text(table + "\n")
    if opts.json:
        opts.json.write_text(json.dumps({"comfyui": version, "rows": rows}, indent=1))
    if opts.readme:
        if not (opts.train and opts.markdown):
            raise SystemExit("--readme needs --train and --markdown (the section says what trains, and links the table)")
        link = opts.markdown.resolve().relative_to(opts.readme.resolve().parent).as_posix()
        replace_readme_section(opts.readme, version, readme_section(version, lines[0], rows, link))
    print(table)
    print(lines[0])


if __name__ == "__main__":
    main()
