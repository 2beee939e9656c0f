"""SD3 / SD3.5 (MMDiT): rectified flow, conditioned on the text sequence and the pooled vector."""
from __future__ import annotations

import torch

from .base import ModelFamily, init_weights

ATTENTION = (r"joint_blocks\.\d+\.(context_block|x_block)\.attn2?\.(qkv|proj)$",)
FEED_FORWARD = (r"joint_blocks\.\d+\.(context_block|x_block)\.mlp\.fc[12]$",)


class SD3Family(ModelFamily):
    name = "sd3"
    display_name = "SD3"
    base_model_version = "sd3"
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}
    # depth sets the width (64 per block, as ComfyUI's detection reads it); text and pooled sizes are free
    scratch_sizes = {
        "tiny": dict(depth=2, context_dim=64, pooled_dim=32, pos_embed_max_size=16),
        "small": dict(depth=8, context_dim=512, pooled_dim=256, pos_embed_max_size=64),
        "medium": dict(depth=16, context_dim=4096, pooled_dim=2048, pos_embed_max_size=96),
    }

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base
        return isinstance(base_model, comfy.model_base.SD3)

    def checkpoint_blocks(self):
        return list(self.diffusion_model.joint_blocks)

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, depth: int = 2, context_dim: int = 64, pooled_dim: int = 32,
                           pos_embed_max_size: int = 16, **_):
        import comfy.ops
        from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
        model = OpenAISignatureMMDITWrapper(input_size=None, patch_size=2, in_channels=16, out_channels=16, depth=depth,
                      adm_in_channels=pooled_dim, pos_embed_max_size=pos_embed_max_size,
                      num_patches=pos_embed_max_size ** 2, pos_embed_scaling_factor=None,
                      context_embedder_config={"target": "torch.nn.Linear",
                                               "params": {"in_features": context_dim, "out_features": 64 * depth}},
                      operations=comfy.ops.disable_weight_init)
        init_weights(model, seed)
        with torch.no_grad():  # a buffer ComfyUI leaves empty (checkpoints carry it): small random positions
            model.pos_embed.copy_(torch.randn(model.pos_embed.shape, generator=torch.Generator().manual_seed(seed)) * 0.02)
        return {k: v.contiguous() for k, v in model.state_dict().items()}

