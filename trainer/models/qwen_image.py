"""Qwen-Image and Qwen-Image-Edit (MMDiT, 60 dual-stream blocks): rectified flow on the Wan VAE's latents (one-frame
videos, B C 1 H W), conditioned on Qwen2.5-VL hidden states (3584 wide) alone.

Qwen-Image-Edit has Qwen-Image's architecture (ComfyUI detects both as qwen_image); its source image comes in as
ReferenceLatent conditioning (what TextEncodeQwenImageEdit adds), so items with reference images train the edit
model and items without train text-to-image."""
from __future__ import annotations

from .base import ModelFamily, UnsupportedSetting, random_state_dict
from .references import ReferenceLatentsInput

ATTENTION = (r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$",)
FEED_FORWARD = (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.(0\.proj|2)$",)
TEXT_WIDTH = 3584  # Qwen2.5-VL 7B's hidden size: ComfyUI fixes the model's text input at it


class QwenImageFamily(ReferenceLatentsInput, ModelFamily):
    name = "qwen_image"
    display_name = "Qwen-Image"
    base_model_version = "qwen_image"
    latent_ndim = 5
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base
        return type(base_model) is comfy.model_base.QwenImage

    def checkpoint_blocks(self):
        return list(self.diffusion_model.transformer_blocks)

    @classmethod
    def scratch_size_for_text(cls, size: dict, text_width: int, pooled_width: int | None) -> dict:
        if text_width != TEXT_WIDTH:
            raise UnsupportedSetting(f"clip: Qwen-Image models take {TEXT_WIDTH}-wide text embeddings (Qwen2.5-VL 7B, "
                                     f"as ComfyUI builds them); this text encoder gives {text_width}")
        return size

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, num_layers: int = 1, **_):
        """ComfyUI reads only the depth and the input width from the weights (3072 wide, 24 heads, 3584-wide text
        are fixed): one block is ~380M parameters."""
        import comfy.ops
        from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
        model = QwenImageTransformer2DModel(in_channels=64, out_channels=16, num_layers=num_layers,
                                            joint_attention_dim=TEXT_WIDTH, operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)
