"""Any other diffusion model ComfyUI loads: adapters on its linear layers, conditioning from ComfyUI's
own extra_conds, the objective from its model_sampling (epsilon, v-prediction or flow).

It trains what ComfyUI's sampler would run with a text embedding (and pooled vector, where the model
takes one); inputs a model needs beyond those (reference images, masks) are left at ComfyUI's defaults.
"""
from __future__ import annotations

from .base import ModelFamily, block_lists

# AuraFlow names its projections w1q..w2o (text and image streams) and c_fc1/c_fc2/c_proj
ATTENTION = (r"(attn|attention)[^.]*\.(to_q|to_k|to_v|to_out\.0|q|k|v|o|qkv|proj|out|q_proj|k_proj|v_proj|o_proj|w[12][qkvo])$",)
FEED_FORWARD = (r"(mlp|ffn|ff|feed_forward)[^.]*\.(\d+|fc[12]|w[123]|net\.0\.proj|net\.2|proj|linear[12]|c_fc[12]|c_proj)$",)


class GenericFamily(ModelFamily):
    name = "generic"
    display_name = "generic"
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}

    def __init__(self, base_model, prediction: str, patcher=None):
        super().__init__(base_model, prediction, patcher)
        self.display_name = f"generic ({type(base_model.model_config).__name__})"
        self.base_model_version = type(base_model.model_config).__name__.lower()
        # a video class (its latent format has a frame axis) takes B C T H W: an image dataset's latents become
        # one-frame videos, as the video families make them
        if getattr(base_model.latent_format, "latent_dimensions", 2) == 3:
            self.latent_ndim = 5

    @classmethod
    def matches(cls, base_model) -> bool:
        return True

    def checkpoint_blocks(self):
        blocks = block_lists(self.diffusion_model)
        if not blocks:
            raise ValueError(f"{self.display_name}: no block list found for gradient checkpointing; turn it off")
        return blocks
