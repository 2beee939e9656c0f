"""Flux (dev and schnell): rectified flow on packed 2x2 patches, conditioned on T5 text, the pooled CLIP
vector and, for guidance-distilled models (dev), a guidance value (`train.guidance`, 1 by default as
Flux dev LoRAs are usually trained)."""
from __future__ import annotations

import torch

from .base import Batch, ModelFamily, UnsupportedSetting, init_weights, residuals_out_of_place

ATTENTION = (r"double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)$", r"single_blocks\.\d+\.linear[12]$")
FEED_FORWARD = (r"double_blocks\.\d+\.(img|txt)_mlp\.[02]$",)


class FluxFamily(ModelFamily):
    name = "flux"
    display_name = "Flux"
    base_model_version = "flux1"
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}
    # ComfyUI detects Flux at its full width (3072, 24 heads, 4096-wide text); only the depths are free
    scratch_sizes = {"tiny": dict(depth=1, depth_single_blocks=0, vec_in_dim=64)}

    def __init__(self, base_model, prediction: str, patcher=None):
        super().__init__(base_model, prediction, patcher)
        residuals_out_of_place(self.checkpoint_blocks())  # ComfyUI's blocks add residuals in place

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base
        return type(base_model) is comfy.model_base.Flux

    @property
    def guidance_distilled(self) -> bool:
        return getattr(self.diffusion_model.params, "guidance_embed", False)

    def check_settings(self, spec) -> None:
        super().check_settings(spec)
        if spec.train.guidance != 1.0 and not self.guidance_distilled:
            raise UnsupportedSetting("train.guidance: this Flux model has no guidance input (schnell); "
                                     "leave guidance at 1")

    def checkpoint_blocks(self):
        return [*self.diffusion_model.double_blocks, *self.diffusion_model.single_blocks]

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        if batch.pooled is None:
            raise UnsupportedSetting("dataset: Flux needs pooled text embeddings (its CLIP-L vector); cache the "
                                     "captions with a Flux CLIP")
        return {**super().extra_cond_inputs(batch, x_noisy),
                "guidance": self.guidance if self.guidance_distilled else None}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, depth: int = 1, depth_single_blocks: int = 0, vec_in_dim: int = 768,
                           guidance_embed: bool = True, **_):
        import comfy.ops
        from comfy.ldm.flux.model import Flux
        model = Flux(in_channels=16, out_channels=16, vec_in_dim=vec_in_dim, context_in_dim=4096, hidden_size=3072,
                     mlp_ratio=4.0, num_heads=24, depth=depth, depth_single_blocks=depth_single_blocks,
                     axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=guidance_embed,
                     operations=comfy.ops.disable_weight_init)
        return {k: v.contiguous() for k, v in init_weights(model, seed).state_dict().items()}
