"""Lumina Image 2.0 (NextDiT): rectified flow on Flux-VAE latents, conditioned on Gemma-2 2B hidden states. ComfyUI
fixes the width (2304, 24 heads, 8 key/value heads) and the two noise- and two context-refiner blocks; the depth
and the text width are read from the weights."""
from __future__ import annotations

import torch

from .base import Batch, ModelFamily, UnsupportedSetting, random_state_dict
from .stages import StageInput, ends_here, holding_all_but

_BLOCKS = r"(layers|noise_refiner|context_refiner)\.\d+\."
ATTENTION = (_BLOCKS + r"attention\.(qkv|out)$",)
FEED_FORWARD = (_BLOCKS + r"feed_forward\.w[123]$",)


class Lumina2Family(ModelFamily):
    name = "lumina2"
    text_input_layer = r"^cap_embedder\.1$"  # after its RMSNorm
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

    def pipeline_layers(self):
        if hasattr(self.diffusion_model, "dec_net"):
            raise UnsupportedSetting("distributed.pipeline_stages: Z-Image's pixel-space variant "
                                     "decodes its patches from the image itself after the blocks, which pipeline "
                                     "stages do not carry yet; use 1 stage")
        return [Lumina2Begin(self), *(Lumina2Block(b) for b in self.diffusion_model.layers), Lumina2End(self)]

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


class Lumina2Begin(StageInput):
    """Stage input: noise, embed time and caption, patchify, and run the caption and noise refiners (NextDiT._forward
    up to its layers, through ComfyUI's own patchify_and_embed). Holds every part of the model but its layers and
    final layer. Tuple out: (tokens, the modulation input, rotary frequencies, geometry[, attention mask]) with
    geometry one row (patch-padded height, width, caption tokens, height, width) per sample."""

    def __init__(self, family):
        super().__init__(family)
        holding_all_but(self, family.diffusion_model, ("layers", "final_layer"))  # Z-Image's padding tokens too

    def forward(self, inputs):
        import comfy.ldm.common_dit
        model = self.family.diffusion_model
        x, timesteps, kwargs = self.model_inputs(inputs)
        context, mask = kwargs["context"], kwargs.get("attention_mask")
        height, width = x.shape[-2:]
        x = comfy.ldm.common_dit.pad_to_patch_size(x, (model.patch_size, model.patch_size))
        adaln = model.t_embedder((1.0 - timesteps) * getattr(model, "time_scale", 1.0), dtype=x.dtype)
        if getattr(model, "clip_text_pooled_proj", None) is not None:  # ComfyUI 0.33's Lumina with a pooled input
            pooled = kwargs.get("clip_text_pooled")
            pooled = model.clip_text_pooled_proj(pooled) if pooled is not None else \
                torch.zeros((x.shape[0], model.clip_text_dim), device=x.device, dtype=x.dtype)
            adaln = model.time_text_embed(torch.cat((adaln, pooled), dim=-1))
        if hasattr(model, "embed_cap"):  # ComfyUI 0.33 embeds the caption inside patchify_and_embed
            img, mask, sizes, captions, freqs, zero_index = model.patchify_and_embed(
                x, context, mask, adaln, kwargs["num_tokens"], transformer_options={})
            assert zero_index is None  # set by reference images only, which pipeline stages refuse
        else:
            img, mask, sizes, captions, freqs = model.patchify_and_embed(
                x, model.cap_embedder(context), mask, adaln, kwargs["num_tokens"], transformer_options={})
        geometry = torch.tensor([[*size, caption, height, width] for size, caption in zip(sizes, captions)],
                                device=x.device)
        return (*self.sendable(img, adaln, freqs.to(img.device)), geometry,
                *(self.sendable(mask) if mask is not None else ()))


class Lumina2Block(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        img, adaln, freqs, geometry, *mask = inputs
        return (self.block(img, mask[0] if mask else None, freqs, adaln, transformer_options={}), adaln, freqs,
                geometry, *mask)


class Lumina2End(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        self.final_layer = family.diffusion_model.final_layer
        self.unpatchify = family.diffusion_model.unpatchify  # a method (the model's patch size): no weights

    def forward(self, inputs):
        img, adaln, freqs, geometry, *mask = inputs
        rows = geometry.tolist()
        out = self.unpatchify(self.final_layer(img, adaln), [(h, w) for h, w, *_ in rows],
                              [caption for _, _, caption, _, _ in rows], return_tensor=True)
        height, width = rows[0][3:]
        return ends_here(-out[:, :, :height, :width], freqs, *mask)
