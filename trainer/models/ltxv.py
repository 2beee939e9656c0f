"""LTX-Video: rectified flow on 128-channel video latents (B, C, T, H, W), one token per latent pixel, T5-XXL
text. An image is a one-frame video."""
from __future__ import annotations

import torch

from ..comfy_compat import ltx_rope_split_mode
from .base import Batch, ModelFamily, UnsupportedSetting, random_state_dict
from .stages import StageInput, ends_here
from .residuals import residuals_out_of_place

ATTENTION = (r"transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$",)
FEED_FORWARD = (r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)$",)


class LTXVFamily(ModelFamily):
    name = "ltxv"
    text_input_layer = r"^caption_projection\.linear_1$"
    display_name = "LTX-Video"
    base_model_version = "ltxv"
    latent_ndim = 5
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}
    # ComfyUI fixes 32 heads, 128 latent channels and 4096-wide text; it reads the head width and the cross-
    # attention width (the model width: the text is projected to it) from the weights
    scratch_sizes = {"tiny": dict(attention_head_dim=4, num_layers=1)}
    reads_text_mask = True  # T5's mask: its cross-attention leaves the padding tokens out

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base
        return type(base_model) is comfy.model_base.LTXV

    def prepare_for_training(self) -> None:
        super().prepare_for_training()
        residuals_out_of_place(self.checkpoint_blocks())  # its blocks add residuals in place

    def checkpoint_blocks(self):
        return list(self.diffusion_model.transformer_blocks)

    def pipeline_layers(self):
        split_mode = ltx_rope_split_mode(self.diffusion_model)
        return [LTXVBegin(self), *(LTXVBlock(b, split_mode) for b in self.diffusion_model.transformer_blocks),
                LTXVEnd(self)]

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        inputs = super().extra_cond_inputs(batch, x_noisy)
        if self.frame_rate:  # the clips' frame rate, as LTXVConditioning gives it (the model's positions in time)
            inputs["frame_rate"] = self.frame_rate
        return inputs

    def model_kwargs(self, batch: Batch, x_noisy, dtype) -> dict:
        # LTXVModel requires the argument; None (no mask cached: every token counts) is what it does without one
        return {"attention_mask": None, **super().model_kwargs(batch, x_noisy, dtype)}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, attention_head_dim: int = 4, num_layers: int = 1, **_):
        import comfy.ops
        from comfy.ldm.lightricks.model import LTXVModel
        width = 32 * attention_head_dim
        model = LTXVModel(in_channels=128, cross_attention_dim=width, attention_head_dim=attention_head_dim,
                          num_attention_heads=32, caption_channels=4096, num_layers=num_layers,
                          operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)


class LTXVBegin(StageInput):
    """Stage input: noise the batch, patchify, place, embed time and text (LTXVModel._forward up to the blocks).
    Tuple out: (x, context, timestep, embedded_timestep, *positions, shape) with shape = the latent's
    (C, T, H, W) and positions the tensors of the blocks' pe (see comfy_compat.ltx_rope_split_mode). No text
    attention mask crosses the stages (batch_mix refuses a dataset with one)."""

    def __init__(self, family):
        super().__init__(family)
        model = family.diffusion_model
        self.patchify_proj, self.adaln_single = model.patchify_proj, model.adaln_single
        self.caption_projection = model.caption_projection

    def forward(self, inputs):
        model = self.family.diffusion_model
        x_in, timestep, kwargs = self.model_inputs(inputs)
        if ltx_rope_split_mode(model) is not None:
            return self.in_steps(model, x_in, timestep, kwargs)
        from comfy.ldm.lightricks.model import latent_to_pixel_coords, precompute_freqs_cis
        x, latent_coords = model.patchifier.patchify(x_in)
        pixel_coords = latent_to_pixel_coords(latent_coords=latent_coords, scale_factors=model.vae_scale_factors,
                                              causal_fix=model.causal_temporal_positioning)
        fractional_coords = pixel_coords.to(torch.float32)
        fractional_coords[:, 0] = fractional_coords[:, 0] * (1.0 / kwargs.get("frame_rate", 25))
        x = self.patchify_proj(x)
        cos, sin = precompute_freqs_cis(fractional_coords, dim=model.inner_dim, out_dtype=x.dtype)
        batch_size = x.shape[0]
        timestep, embedded_timestep = self.adaln_single((timestep * 1000.0).flatten(),
                                                        {"resolution": None, "aspect_ratio": None},
                                                        batch_size=batch_size, hidden_dtype=x.dtype)
        timestep = timestep.view(batch_size, -1, timestep.shape[-1])
        embedded_timestep = embedded_timestep.view(batch_size, -1, embedded_timestep.shape[-1])
        context = self.caption_projection(kwargs["context"]).view(batch_size, -1, x.shape[-1])
        return (*self.sendable(x, context, timestep, embedded_timestep, cos, sin),
                torch.tensor(x_in.shape[1:], device=x.device))

    def in_steps(self, model, x_in, timestep, kwargs):
        """ComfyUI 0.33's own steps (LTXBaseModel._forward), with no keyframes and no text mask."""
        if getattr(model, "prompt_adaln_single", None) is not None:
            raise UnsupportedSetting("distributed.pipeline_stages: this LTX model's cross-attention takes a prompt "
                                     "timestep, which pipeline stages do not carry; use ZeRO instead")
        batch_size = x_in.shape[0]
        x, pixel_coords, _ = model._process_input(x_in, None, None)
        timestep, embedded_timestep, _ = model._prepare_timestep(timestep, batch_size, x_in.dtype)
        context, _ = model._prepare_context(kwargs["context"], batch_size, x)
        rotation, _ = model._prepare_positional_embeddings(pixel_coords, kwargs.get("frame_rate", 25), x_in.dtype)
        return (*self.sendable(x, context, timestep, embedded_timestep, rotation),
                torch.tensor(x_in.shape[1:], device=x.device))


class LTXVBlock(torch.nn.Module):
    def __init__(self, block, split_mode):
        super().__init__()
        self.block, self.split_mode = block, split_mode

    def forward(self, inputs):
        x, context, timestep, embedded_timestep, *positions, shape = inputs
        pe = tuple(positions) if self.split_mode is None else (positions[0], self.split_mode)
        x = self.block(x, context=context, attention_mask=None, timestep=timestep, pe=pe, transformer_options={})
        return (x, context, timestep, embedded_timestep, *positions, shape)


class LTXVEnd(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        model = family.diffusion_model
        self.scale_shift_table, self.norm_out, self.proj_out = model.scale_shift_table, model.norm_out, model.proj_out
        self.patchifier = model.patchifier

    def forward(self, inputs):
        import math
        x, context, timestep, embedded_timestep, *positions, shape = inputs
        channels, frames, height, width = shape.tolist()
        scale_shift = self.scale_shift_table[None, None].to(device=x.device, dtype=x.dtype) \
            + embedded_timestep[:, :, None]
        shift, scale = scale_shift[:, :, 0], scale_shift[:, :, 1]
        x = self.proj_out(self.norm_out(x) * (1 + scale) + shift)
        x = self.patchifier.unpatchify(latents=x, output_height=height, output_width=width, output_num_frames=frames,
                                       out_channels=channels // math.prod(self.patchifier.patch_size))
        return ends_here(x, context, timestep, *positions)
