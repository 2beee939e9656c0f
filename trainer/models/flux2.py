"""Flux.2 (ComfyUI 0.33's `Flux2`: dev and the Klein sizes): Flux's double and single blocks with one modulation
network shared by all of them, 32-channel latents packed 2x2 into 128 channels (the model's patch size is 1), and
one text embedding (Mistral 3's or Qwen 3's hidden states, which ComfyUI pads to 512 tokens) with no pooled vector.
Rectified flow; a guidance value where the model has a guidance input (`train.guidance`, 1 by default).

ComfyUI 0.3.64 has no Flux.2: there this family matches nothing and builds nothing."""
from __future__ import annotations

import torch

from .base import Batch, random_state_dict, is_comfy_model
from .flux import FluxFamily


class Flux2Family(FluxFamily):
    name = "flux2"
    display_name = "Flux.2"
    base_model_version = "flux2"
    # ComfyUI takes the width from the weights and fixes the head size (128: 4 rope axes of 32), so a tiny Flux.2 is
    # one head wide; the text width is the weights' too
    scratch_sizes = {"tiny": dict(hidden_size=128, depth=1, depth_single_blocks=1, context_in_dim=64)}

    @classmethod
    def matches(cls, base_model) -> bool:
        return is_comfy_model(base_model, "Flux2")

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        # Flux's own refuses a batch without the pooled vector; past it, the reference images (ReferenceLatentsInput,
        # as ReferenceLatent gives them) and the text, which extra_conds pads; Flux.2 takes no pooled vector, so one
        # cached by another encoder is left out (None, not the batch's, which the base hands over)
        return {**super(FluxFamily, self).extra_cond_inputs(batch, x_noisy), "pooled_output": None,
                "guidance": self.guidance if self.guidance_distilled else None}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, hidden_size: int = 128, depth: int = 1, depth_single_blocks: int = 1,
                           context_in_dim: int = 64, guidance_embed: bool = True, **_):
        """The settings ComfyUI's detection gives a Flux.2 state dict (comfy/model_detection.py), at this width."""
        import comfy.ops
        from comfy.ldm.flux.model import Flux, FluxParams
        from ..comfy_compat import build_dit
        model = build_dit(
            Flux, FluxParams, image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None,
            context_in_dim=context_in_dim, hidden_size=hidden_size, mlp_ratio=3.0, num_heads=hidden_size // 128,
            depth=depth, depth_single_blocks=depth_single_blocks, axes_dim=[32, 32, 32, 32], theta=2000,
            patch_size=1, qkv_bias=False, guidance_embed=guidance_embed, txt_ids_dims=[3], global_modulation=True,
            mlp_silu_act=True, ops_bias=False, default_ref_method="index", ref_index_scale=10.0,
            operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)
