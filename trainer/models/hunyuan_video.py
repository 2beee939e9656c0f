"""HunyuanVideo (text-to-video): rectified flow on 16-channel video latents (B, C, T, H, W) with Flux-style
double- and single-stream blocks, conditioned on LLaMA text, the pooled CLIP-L vector and, for the guidance-
distilled release, a guidance value (`train.guidance`, 1 by default). An image is a one-frame video."""
from __future__ import annotations

import torch

from ..comfy_compat import joint_sequence_text_first
from .base import Batch, ModelFamily, UnsupportedSetting, random_state_dict, is_comfy_model
from .stages import StageInput, ends_here
from .residuals import residuals_out_of_place

ATTENTION = (r"double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)$", r"single_blocks\.\d+\.linear[12]$")
FEED_FORWARD = (r"double_blocks\.\d+\.(img|txt)_mlp\.[02]$",)


def refuse_mean_flow(family: ModelFamily) -> None:
    """Refuses a mean-flow (step-distilled) model of ComfyUI's HunyuanVideo layout (time_r_in: HunyuanVideo 1.5's
    and HunyuanImage 2.1's distilled releases, the latter the generic family's). Its forward takes the interval's
    end from the sampler's schedule (transformer_options' sigmas and sample_sigmas), which a training step has none
    of: the first step failed with KeyError 'sigmas'."""
    if getattr(family.diffusion_model, "time_r_in", None) is not None:
        raise UnsupportedSetting(f"model: this {family.display_name} model is a mean-flow (step-distilled) release "
                                 "(it has time_r_in): its forward reads the sampler's step schedule, which training "
                                 "has not; train on the model's base release")


class HunyuanVideoFamily(ModelFamily):
    name = "hunyuan_video"
    text_input_layer = r"^txt_in\.input_embedder$"  # 1.5's too
    pooled_input_layer = r"^vector_in\.in_layer$"  # CLIP-L's pooled vector (1.5 takes none)
    pooled_read_in_part = True
    display_name = "HunyuanVideo"
    base_model_version = "hunyuan_video"
    latent_ndim = 5
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}
    # ComfyUI gives the model width // 128 heads with rotary axes (16, 56, 56): the width is a multiple of 128;
    # the pooled vector is CLIP-L's (768) whenever the model takes one; text width and depths are free
    scratch_sizes = {"tiny": dict(hidden_size=128, depth=1, depth_single_blocks=1)}

    @classmethod
    def matches(cls, base_model) -> bool:
        # the image-to-video variants too: their start image's latent (and mask) is ComfyUI's concat_cond's default
        # where none is given (base.extra_cond_inputs), text-to-video training on the I2V weights
        return any(is_comfy_model(base_model, name)
                   for name in ("HunyuanVideo", "HunyuanVideoI2V", "HunyuanVideoSkyreelsI2V"))

    def prepare_for_training(self) -> None:
        super().prepare_for_training()
        residuals_out_of_place(self.checkpoint_blocks())  # Flux's blocks: residuals added in place

    @property
    def guidance_distilled(self) -> bool:
        return self.diffusion_model.params.guidance_embed

    def check_settings(self, spec) -> None:
        refuse_mean_flow(self)
        super().check_settings(spec)
        if spec.train.guidance != 1.0 and not self.guidance_distilled:
            raise UnsupportedSetting("train.guidance: this HunyuanVideo model has no guidance input; leave "
                                     "guidance at 1")

    def image_size_problem(self, width: int, height: int) -> str | None:
        # ComfyUI's HunyuanVideo cuts the VAE's 8x latent into patches without padding (1.5's patches are 1x1):
        # other sizes failed at the first step with a shape error
        patch = self.diffusion_model.patch_size[-1]
        if width % (8 * patch) or height % (8 * patch):
            return (f"{self.display_name} cuts its latent into {patch}x{patch} patches without padding, so both "
                    f"sides must be multiples of {8 * patch} px; set the dataset's resolution to a multiple of "
                    f"{8 * patch}, or turn aspect buckets on")
        return None

    def checkpoint_blocks(self):
        return [*self.diffusion_model.double_blocks, *self.diffusion_model.single_blocks]

    def pipeline_layers(self):
        model = self.diffusion_model  # (a mean-flow model is refused before: check_settings)
        return [HunyuanVideoBegin(self), *(HunyuanVideoDoubleBlock(b) for b in model.double_blocks),
                *(HunyuanVideoSingleBlock(b, first=n == 0, text_first=joint_sequence_text_first(model))
                  for n, b in enumerate(model.single_blocks)),
                HunyuanVideoEnd(self)]

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        if batch.pooled is None and self.diffusion_model.vector_in is not None:
            raise UnsupportedSetting("dataset: HunyuanVideo needs pooled text embeddings (its CLIP-L vector); "
                                     "cache the captions with a HunyuanVideo CLIP")
        return {**super().extra_cond_inputs(batch, x_noisy),
                "guidance": self.guidance if self.guidance_distilled else None}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, hidden_size: int = 128, depth: int = 1, depth_single_blocks: int = 1,
                           context_in_dim: int = 4096, guidance_embed: bool = True, in_channels: int = 16, **_):
        import comfy.ops
        from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams
        from ..comfy_compat import build_dit
        model = build_dit(
            HunyuanVideo, HunyuanVideoParams, in_channels=in_channels, out_channels=16, patch_size=[1, 2, 2],
            vec_in_dim=768, context_in_dim=context_in_dim, hidden_size=hidden_size, mlp_ratio=4.0,
            num_heads=hidden_size // 128, depth=depth, depth_single_blocks=depth_single_blocks, axes_dim=[16, 56, 56],
            theta=256, qkv_bias=True, guidance_embed=guidance_embed, byt5=False, meanflow=False,
            operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)


class HunyuanVideoBegin(StageInput):
    """Stage input: noise the batch, patchify, embed time, pooled vector, guidance and text (HunyuanVideo._forward /
    forward_orig up to the blocks; no text mask, as the cache holds none). Tuple out: (img, txt, vec, pe, shape)
    with shape = the latent's (C, T, H, W)."""

    def __init__(self, family):
        super().__init__(family)
        model = family.diffusion_model
        self.img_in, self.time_in, self.txt_in = model.img_in, model.time_in, model.txt_in
        self.vector_in = model.vector_in
        self.guidance_in = model.guidance_in if model.params.guidance_embed else None
        # HunyuanVideo 1.5 (ComfyUI 0.33) marks text tokens with a type embedding (0: text, which is all a cached
        # caption gives; glyph text and image tokens come with inputs stage inputs do not carry)
        self.cond_type_embedding = getattr(model, "cond_type_embedding", None)

    def forward(self, inputs):
        from comfy.ldm.flux.layers import timestep_embedding
        model = self.family.diffusion_model
        x_in, timestep, kwargs = self.model_inputs(inputs)
        context, y, guidance = kwargs["context"], kwargs.get("y"), kwargs.get("guidance")
        img_ids = model.img_ids(x_in)
        txt_ids = torch.zeros((x_in.shape[0], context.shape[1], 3), device=x_in.device, dtype=x_in.dtype)
        img = self.img_in(x_in)
        vec = self.time_in(timestep_embedding(timestep, 256, time_factor=1.0).to(img.dtype))
        if self.vector_in is not None:
            vec = vec + self.vector_in(y[:, :model.params.vec_in_dim])
        if self.guidance_in is not None and guidance is not None:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        txt = self.txt_in(context, timestep, None, transformer_options={})
        if self.cond_type_embedding is not None:
            kinds = torch.zeros_like(txt[:, :, 0], device=txt.device, dtype=torch.long)
            txt = txt + self.cond_type_embedding(kinds).to(txt.dtype)
        ids = (txt_ids, img_ids) if joint_sequence_text_first(model) else (img_ids, txt_ids)
        pe = model.pe_embedder(torch.cat(ids, dim=1))
        return (*self.sendable(img, txt, vec, pe), torch.tensor(x_in.shape[1:], device=x_in.device))


def _joined(inputs, text_first: bool):
    """Double-block tuples (img, txt, vec, pe, shape) become single-block ones (img+txt, vec, pe, shape)."""
    img, txt, vec, pe, shape = inputs
    return (torch.cat((txt, img) if text_first else (img, txt), 1), vec, pe, shape)


class HunyuanVideoDoubleBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        img, txt, vec, pe, shape = inputs
        img, txt = self.block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=None, modulation_dims_img=None,
                              modulation_dims_txt=None, transformer_options={})
        return (img, txt, vec, pe, shape)


class HunyuanVideoSingleBlock(torch.nn.Module):
    def __init__(self, block, first: bool, text_first: bool):
        super().__init__()
        self.block, self.first, self.text_first = block, first, text_first

    def forward(self, inputs):
        img, vec, pe, shape = _joined(inputs, self.text_first) if self.first else inputs
        img = self.block(img, vec=vec, pe=pe, attn_mask=None, modulation_dims=None, transformer_options={})
        return (img, vec, pe, shape)


class HunyuanVideoEnd(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        model = family.diffusion_model
        self.final_layer, self.patch_size, self.out_channels = model.final_layer, model.patch_size, model.out_channels
        self.join = len(model.single_blocks) == 0  # else the first single block joined the streams
        self.text_first = joint_sequence_text_first(model)

    def forward(self, inputs):
        img, vec, pe, shape = _joined(inputs, self.text_first) if self.join else inputs
        channels, frames, height, width = shape.tolist()
        grid = [frames // self.patch_size[0], height // self.patch_size[1], width // self.patch_size[2]]
        tokens = grid[0] * grid[1] * grid[2]
        img = img[:, img.shape[1] - tokens:] if self.text_first else img[:, :tokens]
        img = self.final_layer(img, vec, modulation_dims=None)
        img = img.reshape([img.shape[0]] + grid + [self.out_channels] + list(self.patch_size))
        img = img.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(img.shape[0], self.out_channels, frames, height, width)
        return ends_here(img, pe)


class HunyuanVideo15Family(HunyuanVideoFamily):
    """HunyuanVideo 1.5 (ComfyUI 0.33's `HunyuanVideo15`): HunyuanVideo's blocks on 32-channel latents (patch
    1x1x1), Qwen2.5-VL text (a type embedding marks text, glyph text and image tokens) and no pooled vector; its
    input also takes an image condition and a mask (image-to-video), which ComfyUI's concat_cond gives as zeros where
    no start image is set: text-to-video training. ComfyUI 0.3.64 has no HunyuanVideo 1.5."""
    name = "hunyuan_video15"
    display_name = "HunyuanVideo 1.5"
    base_model_version = "hunyuan_video15"
    scratch_sizes = {"tiny": dict(hidden_size=128, depth=1, depth_single_blocks=1, context_in_dim=64)}

    @classmethod
    def matches(cls, base_model) -> bool:
        return is_comfy_model(base_model, "HunyuanVideo15")

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, hidden_size: int = 128, depth: int = 1, depth_single_blocks: int = 1,
                           context_in_dim: int = 64, meanflow: bool = False, **_):
        """What ComfyUI's detection makes of a 1.5 file: 32 noise + 32 image-condition + 1 mask input channels, the
        vision projection 1152 wide (SigLIP's; ComfyUI's class needs it), the type embedding; `meanflow`: the
        step-distilled release's second time input (time_r_in), which check_settings refuses."""
        import comfy.ops
        from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams
        from ..comfy_compat import build_dit
        model = build_dit(
            HunyuanVideo, HunyuanVideoParams, in_channels=65, out_channels=32, patch_size=[1, 1, 1], vec_in_dim=None,
            context_in_dim=context_in_dim, hidden_size=hidden_size, mlp_ratio=4.0, num_heads=hidden_size // 128,
            depth=depth, depth_single_blocks=depth_single_blocks, axes_dim=[16, 56, 56], theta=256, qkv_bias=True,
            guidance_embed=False, byt5=False, meanflow=meanflow, use_cond_type_embedding=True, vision_in_dim=1152,
            meanflow_sum=True, operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)
