"""SD1.x / SD2.x UNets: epsilon or v-prediction on ComfyUI's discrete schedule."""
from __future__ import annotations

import torch

from .base import ModelFamily
from .stages import StageInput, ends_here

UNET_ATTENTION = (r"\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$",)
UNET_FEED_FORWARD = (r"\.ff\.net\.(0\.proj|2)$",)


def is_unet(base_model) -> bool:
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    return isinstance(base_model.diffusion_model, UNetModel) \
        and not base_model.model_config.unet_config.get("use_temporal_resblock", False)


class SDUNetFamily(ModelFamily):
    name = "sd_unet"
    text_input_layer = r"attn2\.to_k$"  # cross-attention's key: SD1.x/SD2.x's and SDXL's
    display_name = "SD1.x/SD2.x UNet"
    diffusers_format = True
    target_patterns = {"attention": UNET_ATTENTION, "attention_ff": UNET_ATTENTION + UNET_FEED_FORWARD}

    def __init__(self, base_model, prediction: str, patcher=None):
        super().__init__(base_model, prediction, patcher)
        name = type(base_model.model_config).__name__
        self.base_model_version = {"SD15": "sd_v1", "SD20": "sd_v2", "SD21UnclipL": "sd_v2",
                                   "SD21UnclipH": "sd_v2"}.get(name, name.lower())

    @classmethod
    def matches(cls, base_model) -> bool:
        return is_unet(base_model) and base_model.model_config.unet_config.get("adm_in_channels") is None

    def checkpoint_blocks(self):
        # ComfyUI's forward_timestep_embed calls a block's layers one by one, never the block's own forward
        unet = self.diffusion_model
        middle = [unet.middle_block] if unet.middle_block is not None else []  # one block: a list of layers
        return [layer for block in (*unet.input_blocks, *middle, *unet.output_blocks) for layer in block]

    def pipeline_layers(self):
        unet = self.diffusion_model
        middle = [UNetBlock(unet.middle_block, "middle")] if unet.middle_block is not None else []
        return [UNetBegin(self), *(UNetBlock(b, "input") for b in unet.input_blocks), *middle,
                *(UNetBlock(b, "output") for b in unet.output_blocks), UNetEnd(unet)]


class UNetBegin(StageInput):
    """Stage input: noise the batch, embed the timestep (and SDXL's size vector). Tuple out: (h, emb, context)."""

    def __init__(self, family):
        super().__init__(family)
        unet = family.diffusion_model
        self.time_embed = unet.time_embed
        self.label_emb = getattr(unet, "label_emb", None) if unet.num_classes is not None else None
        self.model_channels = unet.model_channels

    def forward(self, inputs):
        from comfy.ldm.modules.diffusionmodules.util import timestep_embedding
        x_in, timestep, kwargs = self.model_inputs(inputs)
        emb = self.time_embed(timestep_embedding(timestep, self.model_channels, repeat_only=False).to(x_in.dtype))
        if self.label_emb is not None:
            emb = emb + self.label_emb(kwargs["y"])
        return self.sendable(x_in, emb, kwargs["context"])


class UNetBlock(torch.nn.Module):
    """One input, middle or output block. Tuple: (h, emb, context, *skips); input blocks push their output
    onto the skips, output blocks pop one and concatenate it, as UNetModel._forward does."""

    def __init__(self, block, kind: str):
        super().__init__()
        self.block, self.kind = block, kind

    def forward(self, inputs):
        from comfy.ldm.modules.diffusionmodules.openaimodel import forward_timestep_embed
        h, emb, context, *skips = inputs
        options = {"original_shape": list(h.shape), "transformer_index": 0}
        if self.kind == "output":
            h = torch.cat([h, skips.pop()], dim=1)
            output_shape = skips[-1].shape if skips else None
            h = forward_timestep_embed(self.block, h, emb, context, options, output_shape)
        else:
            h = forward_timestep_embed(self.block, h, emb, context, options)
        if self.kind == "input":
            skips.append(h)
        return (h, emb, context, *skips)


class UNetEnd(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.out = unet.out

    def forward(self, inputs):
        h, emb, context = inputs
        return ends_here(self.out(h), emb, context)
