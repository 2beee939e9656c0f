"""Qwen-Image and Qwen-Image-Edit (MMDiT, 60 dual-stream blocks): rectified flow on the Wan VAE's latents (one-frame
videos, B C 1 H W), conditioned on Qwen2.5-VL hidden states (3584 wide) alone.

Qwen-Image-Edit has Qwen-Image's architecture (ComfyUI detects both as qwen_image); its source image comes in as
ReferenceLatent conditioning (what TextEncodeQwenImageEdit adds), so items with reference images train the edit
model and items without train text-to-image."""
from __future__ import annotations

import inspect

import torch

from .base import ModelFamily, UnsupportedSetting, random_state_dict
from .references import ReferenceLatentsInput, with_references
from .stages import StageInput, ends_here

ATTENTION = (r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$",)
FEED_FORWARD = (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.(0\.proj|2)$",)
TEXT_WIDTH = 3584  # Qwen2.5-VL 7B's hidden size: ComfyUI fixes the model's text input at it


class QwenImageFamily(ReferenceLatentsInput, ModelFamily):
    name = "qwen_image"
    text_input_layer = r"^txt_in$"
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

    def pipeline_layers(self):
        blocks = self.diffusion_model.transformer_blocks
        return [QwenImageBegin(self), *(QwenImageBlock(block) for block in blocks), QwenImageEnd(self)]

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


class QwenImageBegin(StageInput):
    """Stage input: noise, patchify, append the reference images' patches (Qwen-Image-Edit's), place and embed time
    and text (QwenImageTransformer2DModel._forward up to its blocks). Tuple out: (image tokens, text tokens, the time
    embedding, rotary embedding, geometry) with geometry = the patch-padded latent's shape, its own image tokens
    (the references' follow them), the latent's height and width, and where the references' tokens start when they
    take the timestep zero (ComfyUI 0.33's index_timestep_zero; else -1)."""

    takes_references = True

    def __init__(self, family):
        super().__init__(family)
        model = family.diffusion_model
        self.img_in, self.txt_norm, self.txt_in = model.img_in, model.txt_norm, model.txt_in
        self.time_text_embed = model.time_text_embed
        # ComfyUI 0.33's forward (its time embedding takes an additional condition) lays the rotary embedding out
        # as its blocks take it; 0.3.64's had it squeezed and unsqueezed
        self.rotary_as_given = "additional_t_cond" in inspect.signature(type(model)._forward).parameters

    def forward(self, inputs):
        model = self.family.diffusion_model
        x, timestep, kwargs = self.model_inputs(inputs)
        context, mask = kwargs["context"], kwargs.get("attention_mask")
        if mask is not None and not torch.is_floating_point(mask):
            mask = (mask - 1).to(x.dtype) * torch.finfo(x.dtype).max
        image, image_ids, padded_shape = model.process_img(x)
        tokens = image.shape[1]
        image, image_ids, timestep_zero = _referenced(model, image, image_ids, kwargs)
        if timestep_zero:  # the references' tokens (from `tokens` on) take the timestep zero
            timestep = torch.cat([timestep, timestep * 0], dim=0)
        p = model.patch_size
        text_start = round(max(((x.shape[-1] + (p // 2)) // p) // 2, ((x.shape[-2] + (p // 2)) // p) // 2))
        text_ids = torch.arange(text_start, text_start + context.shape[1], device=x.device).reshape(1, -1, 1) \
            .repeat(x.shape[0], 1, 3)
        rotary = model.pe_embedder(torch.cat((text_ids, image_ids), dim=1))
        rotary = rotary.to(x.dtype).contiguous() if self.rotary_as_given else rotary.squeeze(1).unsqueeze(2).to(x.dtype)
        image = self.img_in(image)
        text = self.txt_in(self.txt_norm(context))
        if self.rotary_as_given:
            temb = self.time_text_embed(timestep, image, kwargs.get("additional_t_cond"))
        elif kwargs.get("guidance") is not None:
            temb = self.time_text_embed(timestep, kwargs["guidance"] * 1000, image)
        else:
            temb = self.time_text_embed(timestep, image)
        geometry = torch.tensor([*padded_shape, tokens, *x.shape[-2:], tokens if timestep_zero else -1],
                                device=x.device)
        return (*self.sendable(image, text, temb, rotary), geometry,
                *(self.sendable(mask) if mask is not None else ()))


def _referenced(model, image, image_ids, kwargs):
    """(image tokens, positions, whether the references take the timestep zero) with the reference latents' patches
    appended, as _forward appends them (ComfyUI 0.33 adds negative indices and the timestep zero; the model's
    default_ref_method, as no conditioning of the trainer's names one)."""
    references = kwargs.get("ref_latents")
    if not references:
        return image, image_ids, False
    newer = hasattr(model, "default_ref_method")  # ComfyUI 0.33's model
    method = kwargs.get("ref_latents_method", model.default_ref_method if newer else "index")
    image, image_ids = with_references(model.process_img, image, image_ids, references, method, negative=newer)
    return image, image_ids, newer and method == "index_timestep_zero"


class QwenImageBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        image, text, temb, rotary, geometry, *mask = inputs
        # references at the timestep zero double the time embedding's rows; only then is the device's geometry read
        # (a host sync), and only ComfyUI 0.33's blocks take the index
        zero_index = int(geometry[-1]) if temb.shape[0] != image.shape[0] else -1
        text, image = self.block(hidden_states=image, encoder_hidden_states=text,
                                 encoder_hidden_states_mask=mask[0] if mask else None, temb=temb,
                                 image_rotary_emb=rotary, transformer_options={},
                                 **({"timestep_zero_index": zero_index} if zero_index >= 0 else {}))
        return (image, text, temb, rotary, geometry, *mask)


class QwenImageEnd(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        model = family.diffusion_model
        self.norm_out, self.proj_out = model.norm_out, model.proj_out

    def forward(self, inputs):
        image, text, temb, rotary, geometry, *mask = inputs
        b, c, t, h, w, tokens, height, width, zero_index = geometry.tolist()
        if zero_index >= 0:  # the references' timestep-zero embedding ends with them
            temb = temb.chunk(2, dim=0)[0]
        out = self.proj_out(self.norm_out(image, temb))[:, :tokens].view(b, t, h // 2, w // 2, c, 2, 2)
        out = out.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, t, h, w)[:, :, :, :height, :width]
        return ends_here(out, text, rotary, *mask)
