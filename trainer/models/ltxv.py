"""LTX-Video: rectified flow on 128-channel video latents (B, C, T, H, W), one token per latent pixel, T5-XXL
text. An image is a one-frame video."""
from __future__ import annotations

from .base import Batch, ModelFamily, init_weights, residuals_out_of_place

ATTENTION = (r"transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$",)
FEED_FORWARD = (r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)$",)


class LTXVFamily(ModelFamily):
    name = "ltxv"
    display_name = "LTX-Video"
    base_model_version = "ltxv"
    latent_ndim = 5
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}
    # ComfyUI fixes 32 heads, 128 latent channels and 4096-wide text; it reads the head width and the cross-
    # attention width (the model width: the text is projected to it) from the weights
    scratch_sizes = {"tiny": dict(attention_head_dim=4, num_layers=1)}

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base
        return type(base_model) is comfy.model_base.LTXV

    def prepare_for_training(self) -> None:
        super().prepare_for_training()
        residuals_out_of_place(self.checkpoint_blocks())  # its blocks add residuals in place

    def checkpoint_blocks(self):
        return list(self.diffusion_model.transformer_blocks)

    def model_kwargs(self, batch: Batch, x_noisy, dtype) -> dict:
        # every text token counts: the cache holds the embedding without its padding mask (LTXVModel requires
        # the argument; None is what it does without a mask)
        return {"attention_mask": None, **super().model_kwargs(batch, x_noisy, dtype)}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, attention_head_dim: int = 4, num_layers: int = 1, **_):
        import comfy.ops
        from comfy.ldm.lightricks.model import LTXVModel
        width = 32 * attention_head_dim
        model = LTXVModel(in_channels=128, cross_attention_dim=width, attention_head_dim=attention_head_dim,
                          num_attention_heads=32, caption_channels=4096, num_layers=num_layers,
                          operations=comfy.ops.disable_weight_init)
        return {k: v.contiguous() for k, v in init_weights(model, seed).state_dict().items()}
