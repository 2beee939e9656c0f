"""Wan 2.1 / 2.2 text-to-video DiTs: rectified flow on video latents (B, C, T, H, W); an image is a
one-frame video, so image datasets train it too."""
from __future__ import annotations

from .base import ModelFamily, init_weights

ATTENTION = (r"blocks\.\d+\.(self_attn|cross_attn)\.[qkvo]$",)
FEED_FORWARD = (r"blocks\.\d+\.ffn\.[02]$",)


class WanFamily(ModelFamily):
    name = "wan"
    display_name = "Wan 2.1"
    base_model_version = "wan2.1"
    latent_ndim = 5
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}
    # ComfyUI reads the width from the weights and gives it width // 128 heads; text is 4096-wide (umT5)
    scratch_sizes = {
        "tiny": dict(dim=128, ffn_dim=256, num_layers=2),
        "small": dict(dim=512, ffn_dim=2048, num_layers=8),
        "medium": dict(dim=1536, ffn_dim=8960, num_layers=30),  # Wan 2.1 1.3B
    }

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base
        return isinstance(base_model, comfy.model_base.WAN21) \
            and base_model.model_config.unet_config.get("model_type") == "t2v"

    def checkpoint_blocks(self):
        return list(self.diffusion_model.blocks)

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, dim: int = 128, ffn_dim: int = 256, num_layers: int = 2, **_):
        import comfy.ops
        from comfy.ldm.wan.model import WanModel
        model = WanModel(model_type="t2v", dim=dim, ffn_dim=ffn_dim, num_heads=dim // 128, num_layers=num_layers,
                         operations=comfy.ops.disable_weight_init)
        return {k: v.contiguous() for k, v in init_weights(model, seed).state_dict().items()}
