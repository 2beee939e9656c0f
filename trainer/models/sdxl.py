"""SDXL-family UNets (SDXL, SSD-1B, Vega, KOALA): epsilon / v-prediction with the size and crop embedding.

SDXL is conditioned on the pooled text vector plus the original size, crop and target size of each
image. The cache keeps the pooled vector; the size is the bucket the latent was encoded at, uncropped
(that is what the image looks like to the model, and what a user asks for at sampling time).
"""
from __future__ import annotations

import torch

from .base import Batch, UnsupportedSetting, random_state_dict
from .sd_unet import SDUNetFamily, is_unet


def sdxl_unet_config(channel_mult=(1, 1, 1), transformer_depth=(0, 2, 5), transformer_depth_output=None,
                     num_res_blocks=(1, 1, 1)) -> dict:
    """A small UNet ComfyUI detects as SDXL-family: the model width and input depths detection matches (KOALA-700M's
    by default; SDXL's, SSD-1B's or Vega's with two blocks a level), every level at that width, no transformer blocks
    on the output side."""
    if transformer_depth_output is None:
        transformer_depth_output = [0] * sum(n + 1 for n in num_res_blocks)
    return dict(image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=list(num_res_blocks),
                channel_mult=list(channel_mult), transformer_depth=list(transformer_depth), transformer_depth_middle=-2,
                transformer_depth_output=list(transformer_depth_output), num_head_channels=64, context_dim=2048,
                adm_in_channels=2816, num_classes="sequential", use_spatial_transformer=True,
                use_linear_in_transformer=True, legacy=False, use_temporal_attention=False,
                use_temporal_resblock=False)


class SDXLFamily(SDUNetFamily):
    name = "sdxl"
    display_name = "SDXL"
    base_model_version = "sdxl_base_v1-0"
    # for tests and benches (the New Model node does not offer SDXL): ~60M and ~400M parameters
    scratch_sizes = {"tiny": dict(channel_mult=(1, 1, 1)), "koala": dict(channel_mult=(1, 2, 4))}

    def __init__(self, base_model, prediction: str, patcher=None):
        super(SDUNetFamily, self).__init__(base_model, prediction, patcher)

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base
        return is_unet(base_model) and isinstance(base_model, comfy.model_base.SDXL)

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        if batch.pooled is None:
            raise UnsupportedSetting("dataset: SDXL needs pooled text embeddings; cache the captions with an SDXL "
                                     "CLIP (its pooled output is what SDXL is conditioned on)")
        height, width = (int(s) * 8 for s in x_noisy.shape[-2:])
        return {**super().extra_cond_inputs(batch, x_noisy), "width": width, "height": height, "crop_w": 0,
                "crop_h": 0, "target_width": width, "target_height": height}


    @classmethod
    def scratch_state_dict(cls, seed: int = 0, channel_mult=(1, 1, 1), transformer_depth=(0, 2, 5),
                           num_res_blocks=(1, 1, 1), **_):
        """Random weights of a small SDXL-family UNet ComfyUI detects (see sdxl_unet_config)."""
        import comfy.ops
        from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
        model = UNetModel(**sdxl_unet_config(channel_mult, transformer_depth, num_res_blocks=num_res_blocks),
                          operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)
