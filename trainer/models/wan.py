"""Wan 2.1 / 2.2 text-to-video DiTs: rectified flow on video latents (B, C, T, H, W); an image is a
one-frame video, so image datasets train it too."""
from __future__ import annotations

import torch

from .base import ModelFamily, StageInput, UnsupportedSetting, ends_here, init_weights

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

    def pipeline_layers(self):
        return [WanBegin(self), *(WanBlock(b) for b in self.diffusion_model.blocks), WanEnd(self)]

    @classmethod
    def scratch_size_for_text(cls, size: dict, text_width: int, pooled_width: int | None) -> dict:
        if text_width != 4096:
            raise UnsupportedSetting(f"clip: Wan 2.1 models take 4096-wide text embeddings (umT5-XXL, as ComfyUI "
                                     f"builds them); this text encoder gives {text_width}")
        return size

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, dim: int = 128, ffn_dim: int = 256, num_layers: int = 2, **_):
        import comfy.ops
        from comfy.ldm.wan.model import WanModel
        model = WanModel(model_type="t2v", dim=dim, ffn_dim=ffn_dim, num_heads=dim // 128, num_layers=num_layers,
                         operations=comfy.ops.disable_weight_init)
        return {k: v.contiguous() for k, v in init_weights(model, seed).state_dict().items()}


class WanBegin(StageInput):
    """Stage input: noise the batch, patchify, embed time and text (WanModel._forward / forward_orig up to the
    blocks). Tuple out: (x, e, e0, freqs, context, shape) with shape = (frames, height, width, grid t, h, w)."""

    def __init__(self, family):
        super().__init__(family)
        model = family.diffusion_model
        self.patch_embedding, self.time_embedding = model.patch_embedding, model.time_embedding
        self.time_projection, self.text_embedding = model.time_projection, model.text_embedding

    def forward(self, inputs):
        import comfy.ldm.common_dit
        from comfy.ldm.wan.model import sinusoidal_embedding_1d
        model = self.family.diffusion_model
        x_in, timestep, kwargs = self.model_inputs(inputs)
        _, _, t, h, w = x_in.shape
        x = comfy.ldm.common_dit.pad_to_patch_size(x_in, model.patch_size)
        freqs = model.rope_encode(t, h, w, device=x.device, dtype=x.dtype)
        x = self.patch_embedding(x.float()).to(x.dtype)
        grid = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding_1d(model.freq_dim, timestep.flatten()).to(dtype=x[0].dtype))
        e = e.reshape(timestep.shape[0], -1, e.shape[-1])
        e0 = self.time_projection(e).unflatten(2, (6, model.dim))
        context = self.text_embedding(kwargs["context"])
        return (*self.sendable(x, e, e0, freqs, context), torch.tensor([t, h, w, *grid], device=x.device))


class WanBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        x, e, e0, freqs, context, shape = inputs
        x = self.block(x, e=e0, freqs=freqs, context=context, context_img_len=None, transformer_options={})
        return (x, e, e0, freqs, context, shape)


class WanEnd(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        self.head = family.diffusion_model.head
        self.unpatchify = family.diffusion_model.unpatchify  # a method: the model stays out of the submodules

    def forward(self, inputs):
        x, e, e0, freqs, context, shape = inputs
        t, h, w, *grid = shape.tolist()
        x = self.unpatchify(self.head(x, e), grid)[:, :, :t, :h, :w]
        return ends_here(x, e0, freqs, context)
