"""HunyuanVideo (text-to-video): rectified flow on 16-channel video latents (B, C, T, H, W) with Flux-style
double- and single-stream blocks, conditioned on LLaMA text, the pooled CLIP-L vector and, for the guidance-
distilled release, a guidance value (`train.guidance`, 1 by default). An image is a one-frame video."""
from __future__ import annotations

import torch

from .base import Batch, ModelFamily, UnsupportedSetting, init_weights, residuals_out_of_place

ATTENTION = (r"double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)$", r"single_blocks\.\d+\.linear[12]$")
FEED_FORWARD = (r"double_blocks\.\d+\.(img|txt)_mlp\.[02]$",)


class HunyuanVideoFamily(ModelFamily):
    name = "hunyuan_video"
    display_name = "HunyuanVideo"
    base_model_version = "hunyuan_video"
    latent_ndim = 5
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}
    # ComfyUI gives the model width // 128 heads with rotary axes (16, 56, 56): the width is a multiple of 128;
    # the pooled vector is CLIP-L's (768) whenever the model takes one; text width and depths are free
    scratch_sizes = {"tiny": dict(hidden_size=128, depth=1, depth_single_blocks=1)}

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base
        return type(base_model) is comfy.model_base.HunyuanVideo  # not the I2V variants (their concat inputs)

    def prepare_for_training(self) -> None:
        super().prepare_for_training()
        residuals_out_of_place(self.checkpoint_blocks())  # Flux's blocks: residuals added in place

    @property
    def guidance_distilled(self) -> bool:
        return self.diffusion_model.params.guidance_embed

    def check_settings(self, spec) -> None:
        super().check_settings(spec)
        if spec.train.guidance != 1.0 and not self.guidance_distilled:
            raise UnsupportedSetting("train.guidance: this HunyuanVideo model has no guidance input; leave "
                                     "guidance at 1")

    def checkpoint_blocks(self):
        return [*self.diffusion_model.double_blocks, *self.diffusion_model.single_blocks]

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        if batch.pooled is None and self.diffusion_model.vector_in is not None:
            raise UnsupportedSetting("dataset: HunyuanVideo needs pooled text embeddings (its CLIP-L vector); "
                                     "cache the captions with a HunyuanVideo CLIP")
        inputs = super().extra_cond_inputs(batch, x_noisy)
        inputs.setdefault("pooled_output", None)  # HunyuanVideo.encode_adm reads it
        return {**inputs, "guidance": self.guidance if self.guidance_distilled else None}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, hidden_size: int = 128, depth: int = 1, depth_single_blocks: int = 1,
                           context_in_dim: int = 4096, guidance_embed: bool = True, **_):
        import comfy.ops
        from comfy.ldm.hunyuan_video.model import HunyuanVideo
        model = HunyuanVideo(in_channels=16, out_channels=16, patch_size=[1, 2, 2], vec_in_dim=768,
                             context_in_dim=context_in_dim, hidden_size=hidden_size, mlp_ratio=4.0,
                             num_heads=hidden_size // 128, depth=depth, depth_single_blocks=depth_single_blocks,
                             axes_dim=[16, 56, 56], theta=256, qkv_bias=True, guidance_embed=guidance_embed,
                             byt5=False, meanflow=False, operations=comfy.ops.disable_weight_init)
        return {k: v.contiguous() for k, v in init_weights(model, seed).state_dict().items()}
