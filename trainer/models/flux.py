"""Flux (dev, schnell and Kontext): rectified flow on packed 2x2 patches, conditioned on T5 text, the pooled CLIP
vector and, for guidance-distilled models (dev), a guidance value (`train.guidance`, 1 by default as
Flux dev LoRAs are usually trained).

Flux Kontext is a Flux dev model (ComfyUI detects and runs it as Flux; nothing in its weights tells it apart), whose
edit source comes in as ReferenceLatent conditioning: items with reference images train it that way (references.py),
items without train plain text-to-image."""
from __future__ import annotations

import torch

from .base import Batch, ModelFamily, UnsupportedSetting, random_state_dict
from .stages import StageInput, ends_here
from .residuals import residuals_out_of_place
from .references import ReferenceLatentsInput, with_references

ATTENTION = (r"double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)$", r"single_blocks\.\d+\.linear[12]$")
FEED_FORWARD = (r"double_blocks\.\d+\.(img|txt)_mlp\.[02]$",)


class FluxFamily(ReferenceLatentsInput, ModelFamily):
    name = "flux"
    text_input_layer = r"^txt_in$"  # Flux.2's too
    pooled_input_layer = r"^vector_in\.in_layer$"  # CLIP-L's pooled vector (Flux.2 and Chroma take none)
    pooled_read_in_part = True
    display_name = "Flux"
    base_model_version = "flux1"
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}
    # ComfyUI detects Flux at its full width (3072, 24 heads, 4096-wide text); only the depths are free
    scratch_sizes = {"tiny": dict(depth=1, depth_single_blocks=0, vec_in_dim=64)}

    def prepare_for_training(self) -> None:
        super().prepare_for_training()
        residuals_out_of_place(self.checkpoint_blocks())  # ComfyUI's blocks add residuals in place

    @classmethod
    def matches(cls, base_model) -> bool:
        import comfy.model_base
        return type(base_model) is comfy.model_base.Flux

    @property
    def guidance_distilled(self) -> bool:
        return getattr(self.diffusion_model.params, "guidance_embed", False)

    def check_settings(self, spec) -> None:
        super().check_settings(spec)
        if spec.train.guidance != 1.0 and not self.guidance_distilled:
            raise UnsupportedSetting("train.guidance: this Flux model has no guidance input (schnell); "
                                     "leave guidance at 1")

    def checkpoint_blocks(self):
        return [*self.diffusion_model.double_blocks, *self.diffusion_model.single_blocks]

    def pipeline_layers(self):
        model = self.diffusion_model
        return [FluxBegin(self), *(FluxDoubleBlock(b) for b in model.double_blocks),
                *(FluxSingleBlock(b, first=n == 0) for n, b in enumerate(model.single_blocks)), FluxEnd(self)]

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        if batch.pooled is None:
            raise UnsupportedSetting("dataset: Flux needs pooled text embeddings (its CLIP-L vector); cache the "
                                     "captions with a Flux CLIP")
        return {**super().extra_cond_inputs(batch, x_noisy),
                "guidance": self.guidance if self.guidance_distilled else None}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, depth: int = 1, depth_single_blocks: int = 0, vec_in_dim: int = 768,
                           guidance_embed: bool = True, **_):
        import comfy.ops
        from comfy.ldm.flux.model import Flux, FluxParams
        from ..comfy_compat import build_dit
        model = build_dit(
            Flux, FluxParams, in_channels=16, out_channels=16, vec_in_dim=vec_in_dim, context_in_dim=4096,
            hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=depth, depth_single_blocks=depth_single_blocks,
            axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=guidance_embed,
            operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)


def _referenced(model, img, img_ids, x_in, kwargs):
    """The reference latents' patches and positions appended to the image's, as _forward appends them (Flux
    Kontext's beside each other, Flux.2's each at the next index), the model's default method (no conditioning of
    the trainer's names one); FluxEnd keeps the image's own tokens."""
    references = kwargs.get("ref_latents")
    if not references:
        return img, img_ids
    method = kwargs.get("ref_latents_method", getattr(model.params, "default_ref_method", "offset"))
    if method == "index_timestep_zero":  # ComfyUI 0.33 modulates those tokens apart in every block
        raise UnsupportedSetting("distributed.pipeline_stages: Flux's reference images at the timestep zero do not "
                                 "split into pipeline stages yet; use 1 stage")
    p = model.patch_size
    origin = (((x_in.shape[-2] + p // 2) // p) * p, ((x_in.shape[-1] + p // 2) // p) * p)
    return with_references(model.process_img, img, img_ids, references, method,
                           getattr(model.params, "ref_index_scale", 1), uxo_origin=origin)


class FluxBegin(StageInput):
    """Stage input: noise, patchify, append the reference images' patches and embed (Flux._forward / forward_orig up
    to the blocks).
    Tuple out: (img, txt, vec, pe, shape, *modulations) with shape = (height, width) of the latent; modulations is
    empty for Flux, and for Flux.2 (one modulation network shared by every block) the shift, scale and gate tensors
    of each block kind, computed once here as forward_orig computes them and carried to the blocks."""

    takes_references = True  # Flux Kontext's and Flux.2's edit sources

    def __init__(self, family):
        super().__init__(family)
        model = family.diffusion_model
        self.img_in, self.time_in, self.vector_in, self.txt_in = model.img_in, model.time_in, model.vector_in, model.txt_in
        self.guidance_in = model.guidance_in if model.params.guidance_embed else None
        self.txt_norm = getattr(model, "txt_norm", None)  # ComfyUI 0.33: Flux-shaped models with a text norm (Ovis)
        self.modulations = torch.nn.ModuleList(getattr(model, name) for name in MODULATIONS if global_modulation(model))

    def forward(self, inputs):
        from comfy.ldm.flux.layers import timestep_embedding
        model = self.family.diffusion_model
        x_in, timestep, kwargs = self.model_inputs(inputs)
        context, y, guidance = kwargs["context"], kwargs.get("y"), kwargs.get("guidance")
        img, img_ids = _referenced(model, *model.process_img(x_in), x_in, kwargs)
        txt_ids = torch.zeros((x_in.shape[0], context.shape[1], len(model.params.axes_dim)), device=x_in.device,
                              dtype=torch.float32)
        for axis in getattr(model.params, "txt_ids_dims", ()):  # Flux.2 numbers the text tokens on these axes
            txt_ids[:, :, axis] = torch.linspace(0, context.shape[1] - 1, steps=context.shape[1], device=x_in.device,
                                                 dtype=torch.float32)
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timestep, 256).to(img.dtype))
        if self.guidance_in is not None and guidance is not None:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        if self.vector_in is not None:
            if y is None:
                y = torch.zeros((img.shape[0], model.params.vec_in_dim), device=img.device, dtype=img.dtype)
            vec = vec + self.vector_in(y[:, :model.params.vec_in_dim])
        txt = self.txt_in(context if self.txt_norm is None else self.txt_norm(context))
        pe = model.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        modulations = [t for network in self.modulations for out in network(vec) if out is not None
                       for t in (out.shift, out.scale, out.gate)]
        return (*self.sendable(img, txt, vec, pe), torch.tensor(x_in.shape[-2:], device=x_in.device),
                *self.sendable(*modulations))


# Flux.2's shared modulation networks, in the order FluxBegin carries their outputs: the double blocks' image and
# text (two shift-scale-gate triples each), the single blocks' (one)
MODULATIONS = ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation")
DOUBLE_MODULATIONS = 12


def global_modulation(model) -> bool:
    return getattr(model.params, "global_modulation", False)


def _modulation_outs(tensors):
    """Carried shift-scale-gate triples back into the ModulationOut pairs ComfyUI's blocks take as `vec`."""
    from comfy.ldm.flux.layers import ModulationOut
    outs = [ModulationOut(*tensors[n:n + 3]) for n in range(0, len(tensors), 3)]
    return tuple(zip(outs[0::2], outs[1::2])) if len(outs) > 1 else (outs[0], None)


def _joined(inputs):
    """Double-block tuples (img, txt, vec, pe, shape, *modulations) become single-block ones (txt+img, vec, pe,
    shape, txt_len, *modulations)."""
    img, txt, vec, pe, shape, *modulations = inputs
    if img.dtype == torch.float16:  # as forward_orig, between the double and the single blocks
        img = torch.nan_to_num(img, nan=0.0, posinf=65504, neginf=-65504)
    return (torch.cat((txt, img), 1), vec, pe, shape, torch.tensor([txt.shape[1]], device=shape.device), *modulations)


class FluxDoubleBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        img, txt, vec, pe, shape, *modulations = inputs
        block_vec = _modulation_outs(modulations[:DOUBLE_MODULATIONS]) if modulations else vec
        img, txt = self.block(img=img, txt=txt, vec=block_vec, pe=pe, attn_mask=None, transformer_options={})
        return (img, txt, vec, pe, shape, *modulations)


class FluxSingleBlock(torch.nn.Module):
    def __init__(self, block, first: bool):
        super().__init__()
        self.block, self.first = block, first

    def forward(self, inputs):
        img, vec, pe, shape, txt_len, *modulations = _joined(inputs) if self.first else inputs
        block_vec = _modulation_outs(modulations[DOUBLE_MODULATIONS:])[0] if modulations else vec
        return (self.block(img, vec=block_vec, pe=pe, attn_mask=None, transformer_options={}), vec, pe, shape,
                txt_len, *modulations)


class FluxEnd(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        self.final_layer = family.diffusion_model.final_layer
        self.patch_size = family.diffusion_model.patch_size
        self.join = len(family.diffusion_model.single_blocks) == 0  # else the first single block joined

    def forward(self, inputs):
        from einops import rearrange
        img, vec, pe, shape, txt_len, *modulations = _joined(inputs) if self.join else inputs
        h, w = shape.tolist()
        p = self.patch_size
        h_len, w_len = (h + p // 2) // p, (w + p // 2) // p
        img = self.final_layer(img[:, int(txt_len):, ...], vec)[:, :h_len * w_len]
        out = rearrange(img, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=h_len, w=w_len, ph=p, pw=p)[:, :, :h, :w]
        return ends_here(out, pe, *modulations)
