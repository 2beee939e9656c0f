"""SD3 / SD3.5 (MMDiT): rectified flow, conditioned on the text sequence and the pooled vector."""
from __future__ import annotations

import torch

from .base import ModelFamily, UnsupportedSetting, init_weights
from .stages import StageInput

ATTENTION = (r"joint_blocks\.\d+\.(context_block|x_block)\.attn2?\.(qkv|proj)$",)
FEED_FORWARD = (r"joint_blocks\.\d+\.(context_block|x_block)\.mlp\.fc[12]$",)


class SD3Family(ModelFamily):
    name = "sd3"
    text_input_layer = r"^context_embedder$"
    pooled_input_layer = r"^y_embedder\.mlp\.0$"  # CLIP-L's and CLIP-G's pooled vectors, joined
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

    def pipeline_layers(self):
        return [SD3Begin(self), *(SD3Block(b) for b in self.diffusion_model.joint_blocks), SD3End(self)]

    @classmethod
    def scratch_size_for_text(cls, size: dict, text_width: int, pooled_width: int | None) -> dict:
        return {**size, "context_dim": text_width, "pooled_dim": pooled_width}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, depth: int = 2, context_dim: int = 64, pooled_dim: int | None = 32,
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
        # a buffer ComfyUI leaves empty (checkpoints carry it) and training never updates: SD3's own 2-D sin-cos
        # positions at unit scale (small random ones leave the model blind to where a patch is)
        from comfy.ldm.modules.diffusionmodules.mmdit import get_2d_sincos_pos_embed
        with torch.no_grad():
            model.pos_embed.copy_(torch.from_numpy(get_2d_sincos_pos_embed(64 * depth, pos_embed_max_size)).unsqueeze(0))
        return {k: v.contiguous() for k, v in model.state_dict().items()}



class SD3Begin(StageInput):
    """Stage input: noise, patchify with positions, embed time, pooled vector and text (MMDiT.forward up to
    its joint blocks). Tuple out: (x, c, context, shape) with shape = (height, width) of the latent."""

    def __init__(self, family):
        super().__init__(family)
        model = family.diffusion_model
        if model.register_length or model.context_processor is not None:
            raise UnsupportedSetting("distributed.pipeline_stages: this MMDiT variant (registers or a context "
                                     "processor) does not split into stages yet")
        self.x_embedder, self.t_embedder = model.x_embedder, model.t_embedder
        self.y_embedder, self.context_embedder = model.y_embedder, model.context_embedder

    def forward(self, inputs):
        import comfy.ops
        x_in, timestep, kwargs = self.model_inputs(inputs)
        hw = x_in.shape[-2:]
        pos = self.family.diffusion_model.cropped_pos_embed(hw, device=x_in.device)
        x = self.x_embedder(x_in) + comfy.ops.cast_to_input(pos, x_in)
        c = self.t_embedder(timestep, dtype=x.dtype)
        if kwargs.get("y") is not None and self.y_embedder is not None:
            c = c + self.y_embedder(kwargs["y"])
        context = self.context_embedder(kwargs["context"])
        return (*self.sendable(x, c, context), torch.tensor(hw, device=x.device))


class SD3Block(torch.nn.Module):
    """A joint block; the last one keeps no text stream, so its tuple is (x, c, shape)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        x, c, context, shape = inputs
        context, x = self.block(context, x, c=c, use_checkpoint=False, transformer_options={})
        return (x, c, context, shape) if context is not None else (x, c, shape)


class SD3End(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        self.final_layer = family.diffusion_model.final_layer
        self.unpatchify = family.diffusion_model.unpatchify  # a method: the model stays out of the submodules

    def forward(self, inputs):
        x, c, shape = inputs
        hw = shape.tolist()
        x = self.unpatchify(self.final_layer(x, c), hw=hw)
        return x[:, :, :hw[-2], :hw[-1]]
