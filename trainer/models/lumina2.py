"""Lumina Image 2.0 (NextDiT): rectified flow on Flux-VAE latents, conditioned on Gemma-2 2B hidden states. ComfyUI
fixes the width (2304, 24 heads, 8 key/value heads) and the two noise- and two context-refiner blocks; the depth
and the text width are read from the weights."""
from __future__ import annotations

import torch

from .base import Batch, ModelFamily, random_state_dict

_BLOCKS = r"(layers|noise_refiner|context_refiner)\.\d+\."
ATTENTION = (_BLOCKS + r"attention\.(qkv|out)$",)
FEED_FORWARD = (_BLOCKS + r"feed_forward\.w[123]$",)


class Lumina2Family(ModelFamily):
    name = "lumina2"
    display_name = "Lumina 2"
    base_model_version = "lumina2"
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base  # and its subclass ZImagePixelSpace (ComfyUI 0.33): the same blocks on RGB patches
        return isinstance(base_model, comfy.model_base.Lumina2)

    def checkpoint_blocks(self):
        model = self.diffusion_model
        return [*model.noise_refiner, *model.context_refiner, *model.layers]

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        # ComfyUI's Gemma encoder hands its attention mask to extra_conds, which makes the model's num_tokens from it
        mask = self.whole_text_mask(batch, x_noisy.device)
        return {**super().extra_cond_inputs(batch, x_noisy), "attention_mask": mask}

    @classmethod
    def scratch_size_for_text(cls, size: dict, text_width: int, pooled_width: int | None) -> dict:
        return {**size, "cap_feat_dim": text_width}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, n_layers: int = 1, cap_feat_dim: int | None = None,
                           variant: str = "lumina2", **_):
        """`variant` "z_image": Z-Image (ComfyUI 0.33's ZImage, the same NextDiT at width 3840 with 30 heads, its
        own modulation and rope, Qwen3-4B's 2560-wide text), which ComfyUI loads as a Lumina 2 model."""
        import comfy.ops
        from comfy.ldm.lumina.model import NextDiT
        if variant == "z_image":  # ComfyUI's detection at width 3840 (model_detection's "Z image")
            shape = dict(dim=3840, cap_feat_dim=cap_feat_dim or 2560, n_heads=30, n_kv_heads=30,
                         axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0,
                         ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0,
                         pad_tokens_multiple=32)
        else:
            shape = dict(dim=2304, cap_feat_dim=cap_feat_dim or 2304, n_heads=24, n_kv_heads=8,
                         axes_dims=[32, 32, 32], axes_lens=[300, 512, 512])
        model = NextDiT(patch_size=2, in_channels=16, n_layers=n_layers, qk_norm=True,
                        operations=comfy.ops.disable_weight_init, **shape)
        return random_state_dict(model, seed)
