"""Krea 2 (ComfyUI 0.33's `Krea2`): a single-stream DiT on the Wan 2.1 VAE's latents (images as one-frame videos,
B C 1 H W), conditioned on the hidden states of several Qwen3-VL layers side by side (ComfyUI hands them as one
tensor, tokens x layers*width), which its own text-fusion transformer mixes. Rectified flow.

ComfyUI 0.3.64 has no Krea 2: there this family matches nothing and builds nothing."""
from __future__ import annotations

import torch

from .base import ModelFamily, random_state_dict, is_comfy_model
from .stages import StageInput, ends_here

ATTENTION = (r"blocks\.\d+\.attn\.(wq|wk|wv|wo|gate)$",)
FEED_FORWARD = (r"blocks\.\d+\.mlp\.(gate|up|down)$",)


class Krea2Family(ModelFamily):
    name = "krea2"
    display_name = "Krea 2"
    base_model_version = "krea2"
    latent_ndim = 5
    # the image blocks only: the text-fusion blocks (txtfusion.*) share the names but mix the encoder's layers
    target_patterns = {"attention": tuple("^" + p for p in ATTENTION),
                       "attention_ff": tuple("^" + p for p in ATTENTION + FEED_FORWARD)}
    # ComfyUI reads the widths, depths and head counts from the weights (heads 128 wide; the text fusion's 20 heads
    # fixed): one block of one head, text from 2 encoder layers 160 wide
    scratch_sizes = {"tiny": dict(features=128, layers=1, txtlayers=2, txtdim=160)}

    @classmethod
    def matches(cls, base_model) -> bool:
        return is_comfy_model(base_model, "Krea2")

    def checkpoint_blocks(self):
        return list(self.diffusion_model.blocks)

    def pipeline_layers(self):
        return [Krea2Begin(self), *(Krea2Block(b) for b in self.diffusion_model.blocks), Krea2End(self)]

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, features: int = 128, layers: int = 1, txtlayers: int = 2,
                           txtdim: int = 160, **_):
        import comfy.ops
        from comfy.ldm.krea2.model import SingleStreamDiT
        heads = features // 128
        model = SingleStreamDiT(features=features, heads=heads, kvheads=heads, layers=layers, channels=16,
                                txtlayers=txtlayers, txtdim=txtdim, operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)


class Krea2Begin(StageInput):
    """Stage input: noise, patchify, embed time and fuse the text layers (SingleStreamDiT._forward up to the blocks;
    no reference images, which pipeline stages refuse). Tuple out: (text+image tokens, the blocks' modulation
    vector, the time vector the last layer takes, rotary frequencies, geometry) with geometry = (text tokens,
    image tokens, patch rows, patch columns, height, width, frames), frames 0 for a 4-D latent."""

    def __init__(self, family):
        super().__init__(family)
        model = family.diffusion_model
        self.first, self.tmlp, self.tproj = model.first, model.tmlp, model.tproj
        self.txtfusion, self.txtmlp = model.txtfusion, model.txtmlp

    def forward(self, inputs):
        from comfy.ldm.flux.layers import timestep_embedding
        model = self.family.diffusion_model
        x, timesteps, kwargs = self.model_inputs(inputs)
        frames = x.shape[2] if x.ndim == 5 else 0
        if frames:
            b, c, _, h, w = x.shape
            x = x.reshape(b * frames, c, h, w)  # as _forward folds the frames (Krea 2's images: one)
        img, imgpos, rows, columns = model.process_img(x)
        img = self.first(img)
        t = self.tmlp(timestep_embedding(timesteps, model.tdim).unsqueeze(1).to(img.dtype))
        context = self.txtmlp(self.txtfusion(model._unpack_context(kwargs["context"]), mask=None,
                                             transformer_options={}))
        txtpos = torch.zeros(x.shape[0], context.shape[1], 3, device=context.device, dtype=torch.float32)
        freqs = model.pe_embedder(torch.cat((txtpos, imgpos), dim=1))
        geometry = torch.tensor([context.shape[1], img.shape[1], rows, columns, *x.shape[-2:], frames],
                                device=x.device)
        return (*self.sendable(torch.cat((context, img), dim=1), self.tproj(t), t, freqs), geometry)


class Krea2Block(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        combined, tvec, t, freqs, geometry = inputs
        return (self.block(combined, tvec, freqs, None, transformer_options={}), tvec, t, freqs, geometry)


class Krea2End(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        model = family.diffusion_model
        self.last, self.patch, self.channels = model.last, model.patch, model.channels

    def forward(self, inputs):
        from einops import rearrange
        combined, tvec, t, freqs, geometry = inputs
        text, tokens, rows, columns, height, width, frames = geometry.tolist()
        out = self.last(combined, t)[:, text:text + tokens]
        out = rearrange(out, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=rows, w=columns, ph=self.patch,
                        pw=self.patch, c=self.channels)[:, :, :height, :width]
        if frames:
            out = out.reshape(-1, frames, self.channels, height, width).movedim(1, 2)
        return ends_here(out, tvec, freqs)
