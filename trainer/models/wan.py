"""Wan 2.1 / 2.2 DiTs: rectified flow on video latents (B, C, T, H, W); an image is a one-frame video, so image
datasets train them too. One family, four variants ComfyUI tells apart by their weights:

- text-to-video (Wan 2.1 and the 2.2 14B experts, which ComfyUI loads alike);
- image-to-video with a 16-channel concat input (Wan 2.1 i2v, with its CLIP-vision projection; the Wan 2.2
  14B i2v experts, without): the start image goes in as ComfyUI's WanImageToVideo hands it, the concat latent
  and mask that model_base.WAN21.concat_cond joins to the noisy latent;
- the Wan 2.2 5B TI2V (48-channel latents, model_base.WAN22): the start image is the latent's first frame,
  kept clean, with a zero timestep there (Wan22ImageToVideoLatent's noise mask) and no loss on it (ComfyUI's
  sampler puts the start image back over whatever the model predicts there).

Without a reference image every variant trains as ComfyUI runs it with no start image.
"""
from __future__ import annotations

import torch

from .base import Batch, ModelFamily, UnsupportedSetting, random_state_dict
from .stages import StageInput, ends_here

ATTENTION = (r"blocks\.\d+\.(self_attn|cross_attn)\.[qkvo]$",)
FEED_FORWARD = (r"blocks\.\d+\.ffn\.[02]$",)


# variant → (display name, kohya ss_base_model_version)
VARIANTS = {
    "t2v": ("Wan 2.1", "wan2.1"),  # the Wan 2.2 14B text-to-video experts load exactly alike
    "i2v_2.1": ("Wan 2.1 image-to-video", "wan2.1_i2v"),
    "i2v_2.2": ("Wan 2.2 image-to-video", "wan2.2_i2v"),
    "ti2v_5b": ("Wan 2.2 TI2V 5B", "wan2.2_ti2v_5b"),
}
I2V_EXTRA_CHANNELS = 20  # WanImageToVideo: a 4-channel mask and the 16-channel start-image latent


def wan_variant(base_model) -> str | None:
    """Which Wan variant a ComfyUI model is, from the class ComfyUI built and the patch embedding's input width;
    None for Wan models that take other inputs (VACE, Fun control, camera, sound, HuMo, Animate)."""
    import comfy.model_base
    config = base_model.model_config.unet_config
    if type(base_model) not in (comfy.model_base.WAN21, comfy.model_base.WAN22) \
            or config.get("model_type") not in ("t2v", "i2v"):
        return None
    model = base_model.diffusion_model
    extra = model.patch_embedding.weight.shape[1] - model.out_dim
    if type(base_model) is comfy.model_base.WAN22:
        return "ti2v_5b" if extra == 0 else None
    if extra == 0 and config["model_type"] == "t2v":
        return "t2v"
    if extra == I2V_EXTRA_CHANNELS:
        return "i2v_2.1" if config["model_type"] == "i2v" else "i2v_2.2"
    return None


class WanFamily(ModelFamily):
    name = "wan"
    text_input_layer = r"^text_embedding\.0$"
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

    def __init__(self, base_model, prediction: str, patcher=None):
        super().__init__(base_model, prediction, patcher)
        self.variant = wan_variant(base_model) or "t2v"  # family "wan" forced on another Wan: as text-to-video
        self.display_name, self.base_model_version = VARIANTS[self.variant]
        self.reference_input = None if self.variant == "t2v" else "start_image"

    @classmethod
    def matches(cls, base_model) -> bool:
        return wan_variant(base_model) is not None

    def checkpoint_blocks(self):
        return list(self.diffusion_model.blocks)

    def pipeline_layers(self):
        if self.variant != "t2v":  # stage inputs carry no reference images
            raise UnsupportedSetting(f"distributed.pipeline_stages: {self.display_name} models take a start image, "
                                     "which does not cross pipeline stages yet; use 1 stage")
        return [WanBegin(self), *(WanBlock(b) for b in self.diffusion_model.blocks), WanEnd(self)]

    # --- the start image, as ComfyUI's image-to-video nodes hand it to the model ------------------------------
    def start_latents(self, batch: Batch, frames: int) -> torch.Tensor | None:
        """The batch's start image (its first reference slot) as raw latents in the model's layout, or None."""
        if self.variant == "t2v" or not batch.references:
            return None
        if len(batch.references) > 1:
            raise ValueError(f"Batch.references: {self.display_name} takes one start image per item; these items "
                             f"have {len(batch.references)} reference images (name.ref.png, name.ref2.png ...)")
        start = self.to_model_layout(batch.references[0])
        if self.variant != "ti2v_5b" and start.shape[2] != frames:
            raise ValueError(f"Batch.references: {self.display_name} takes the start image as WanImageToVideo "
                             f"encodes it, the image followed by gray frames to the clip's length ({frames} latent "
                             f"frames); this reference has {start.shape[2]}")
        return start

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        inputs = super().extra_cond_inputs(batch, x_noisy)
        start = self.start_latents(batch, x_noisy.shape[2]) if self.variant != "ti2v_5b" else None
        if start is not None:  # WanImageToVideo's conditioning values; WAN21.concat_cond scales and joins them
            mask = torch.ones((1, 1, *x_noisy.shape[2:]), device=x_noisy.device)
            mask[:, :, :1] = 0.0  # one start image: its latent frame is given, the rest generated
            inputs.update(concat_latent_image=start.float(), concat_mask=mask)
        if self.start_frames(batch, x_noisy.shape[2]):
            inputs["denoise_mask"] = self.denoise_mask(batch, x_noisy)
        return inputs

    def start_frames(self, batch: Batch, frames: int) -> int:
        """TI2V: how many leading latent frames the start image fills: its first latent frame (a causal video VAE
        encodes a single image there, and the image alone or followed by gray frames alike), where the latent has
        frames after it; else 0, trained as text-to-video (an image item's start image leaves nothing to generate)."""
        start = self.start_latents(batch, frames) if self.variant == "ti2v_5b" else None
        return 1 if start is not None and frames > 1 else 0

    def denoise_mask(self, batch: Batch, like: torch.Tensor) -> torch.Tensor:
        """Wan22ImageToVideoLatent's noise mask: 0 on the start image's frames, 1 where the model generates."""
        mask = torch.ones((like.shape[0], 1, *like.shape[2:]), device=like.device)
        mask[:, :, :self.start_frames(batch, like.shape[2])] = 0.0
        return mask

    def model_inputs(self, batch: Batch):
        frames = self.to_model_layout(batch.latents).shape[2]
        if self.start_frames(batch, frames) == 0:
            return super().model_inputs(batch)
        # TI2V with a start image, as ComfyUI samples it: the latent's first frames are the start image's, put back
        # clean over the noise at every step (KSamplerX0Inpaint with WAN22.scale_latent_inpaint), and the timestep
        # goes per frame, 0 there (WAN22.process_timestep with the noise mask)
        sampling, dtype = self.base_model.model_sampling, self.weight_dtype()
        x0, noise, sigma = self.noising(batch.latents, batch.noise, batch.timesteps)
        x0 = self.with_start_image(x0, batch)
        keep = self.denoise_mask(batch, x0)
        shape = (-1,) + (1,) * (x0.dim() - 1)
        x_noisy = sampling.noise_scaling(sigma.view(shape), noise, x0)
        x_noisy = x_noisy * keep + x0 * (1.0 - keep)
        x_in = sampling.calculate_input(sigma.view(shape), x_noisy)
        kwargs = self.model_kwargs(batch, x_noisy, dtype)  # extra_cond_inputs adds the noise mask
        timestep = self.base_model.process_timestep(sampling.timestep(sigma).float(), x=x_noisy,
                                                    denoise_mask=kwargs["denoise_mask"])
        return x_in.to(dtype), timestep, kwargs

    def with_start_image(self, x0: torch.Tensor, batch: Batch) -> torch.Tensor:
        start = self.base_model.process_latent_in(self.start_latents(batch, x0.shape[2]).float().to(x0.device))
        n = self.start_frames(batch, x0.shape[2])
        return torch.cat([start[:, :, :n], x0[:, :, n:]], dim=2)

    def loss(self, batch: Batch, reduce: bool = True, weighted: bool = True) -> torch.Tensor:
        x_in, timestep, kwargs = self.model_inputs(batch)
        out = self.run_model(x_in, timestep, kwargs)
        mask = batch.mask
        if self.start_frames(batch, x_in.shape[2]):  # the start image's frames are given, never predicted
            keep = self.denoise_mask(batch, x_in)
            mask = keep if mask is None else keep * self.to_model_layout(mask).to(keep.device)
        return self.loss_of_output(out, batch.latents, batch.noise, batch.timesteps, reduce, weighted, mask)

    @classmethod
    def scratch_size_for_text(cls, size: dict, text_width: int, pooled_width: int | None) -> dict:
        if text_width != 4096:
            raise UnsupportedSetting(f"clip: Wan 2.1 models take 4096-wide text embeddings (umT5-XXL, as ComfyUI "
                                     f"builds them); this text encoder gives {text_width}")
        return size

    # variant → (ComfyUI model_type, input channels, output channels) that ComfyUI's detection reads back
    SCRATCH_VARIANTS = {"t2v": ("t2v", 16, 16), "i2v_2.1": ("i2v", 36, 16), "i2v_2.2": ("t2v", 36, 16),
                        "ti2v_5b": ("t2v", 48, 48)}

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, dim: int = 128, ffn_dim: int = 256, num_layers: int = 2,
                           variant: str = "t2v", **_):
        import comfy.ops
        from comfy.ldm.wan.model import WanModel
        model_type, in_dim, out_dim = cls.SCRATCH_VARIANTS[variant]
        model = WanModel(model_type=model_type, in_dim=in_dim, out_dim=out_dim, dim=dim, ffn_dim=ffn_dim,
                         num_heads=dim // 128, num_layers=num_layers, operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)


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
