"""Preview images during training: ComfyUI's own sampler on the current weights, decoded by the graph's VAE.

The Train node encodes the prompts with the graph's CLIP and hands the trainer the conditioning and
the VAE weights as files, so previews need no text encoder in the trainer. Every rank samples (under
ZeRO-3 each forward pass gathers weights from all ranks); rank 0 writes the images.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from .comfy_compat import dequantize_per_matmul_again, forget_loaded
from .spec import SampleSpec
from .run.layout import SAMPLES_DIR

log = logging.getLogger("ingraph_trainer.sampling")


def conditioning_tensors(conditioning: list, prefix: str) -> dict[str, torch.Tensor]:
    """ComfyUI conditioning ([[tensor, {extras}]]) as flat tensors; non-tensor extras are dropped."""
    cond, extras = conditioning[0][0], conditioning[0][1]
    out = {f"{prefix}.cond": cond.detach().cpu().contiguous()}
    for key, value in extras.items():
        if isinstance(value, torch.Tensor):
            out[f"{prefix}.{key}"] = value.detach().cpu().contiguous()
    return out


def conditioning_from(tensors: dict[str, torch.Tensor], prefix: str) -> list:
    extras = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".") and k != f"{prefix}.cond"}
    return [[tensors[f"{prefix}.cond"], extras]]


def sample_latent(patcher, positive, negative, seed: int, *, steps: int, cfg: float, sampler: str, scheduler: str,
                  width: int, height: int) -> torch.Tensor:
    """One latent the way ComfyUI's Empty Latent Image + KSampler make it."""
    from .comfy_compat import latent_cell_pixels, sample
    latent_format = patcher.get_model_object("latent_format")
    # the model's own pixels per latent cell (16 for Wan 2.2's and Flux.2's latents, 1 for a pixel-space model's)
    ratio = latent_cell_pixels(latent_format)
    empty = torch.zeros((1, latent_format.latent_channels, max(1, height // ratio), max(1, width // ratio)))
    return sample(patcher, empty, seed, steps, cfg, sampler, scheduler, positive, negative)


@contextlib.contextmanager
def on_the_trainers_device(patcher):
    """ComfyUI samples through the training model's own patcher, and its memory manager then counts that model as
    one it loaded: on a nearly full card the VAE decode's free_memory would move its smallest modules (the LoRA
    leaves) to the offload device in the middle of a run. While sampling, the patcher's offload device is its load
    device (the trainer's), so nothing it holds leaves the device; afterwards ComfyUI's list no longer holds it."""
    offload = patcher.offload_device
    patcher.offload_device = patcher.load_device
    try:
        yield
    finally:
        patcher.offload_device = offload
        forget_loaded(patcher, unload=False)
        dequantize_per_matmul_again(getattr(patcher, "model", None))


def to_pixels(image: torch.Tensor):
    """A decoded image (H, W, C in [0, 1]) as uint8 numpy pixels for PIL."""
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()


def sample_due(spec: SampleSpec, step: int, total: int) -> bool:
    return bool(spec.every) and step > 0 and (step % spec.every == 0 or step == total)


def image_names(step: int, count: int) -> list[str]:
    return [f"{SAMPLES_DIR}/step{step:06d}_{i}.png" for i in range(count)]


def load_vae(spec: SampleSpec):
    """The previews' VAE as the graph loaded it: a VAE file (VAELoader) or the VAE inside a checkpoint (Load
    Checkpoint; its diffusion model and text encoders are not built)."""
    from .comfy_compat import load_vae_file
    if spec.vae_format not in ("vae", "checkpoint"):
        raise ValueError(f"samples.vae_format: {spec.vae_format!r} is not one of vae, checkpoint")
    return load_vae_file(spec.vae_path, from_checkpoint=spec.vae_format == "checkpoint")


class PreviewSampler:
    def __init__(self, spec: SampleSpec, family, run_dir: Path, write: bool):
        from safetensors.torch import load_file
        self.spec = spec
        self.family = family
        self.run_dir = Path(run_dir)
        self.write = write
        tensors = load_file(spec.conditioning)
        self.positives = [conditioning_from(tensors, f"positive.{i}") for i in range(len(spec.prompts))]
        self.negative = conditioning_from(tensors, "negative")
        self._vae = None

    def vae(self):
        if self._vae is None:
            self._vae = load_vae(self.spec)
        return self._vae

    @contextlib.contextmanager
    def _inference_weights(self, module):
        """Eval mode, the model's real dtype for ComfyUI, and the global RNG untouched (dropout, resume)."""
        diffusion_model = self.family.diffusion_model
        declared = getattr(diffusion_model, "dtype", None)
        was_training = module.training
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            module.eval()
            diffusion_model.dtype = self.family.weight_dtype()  # fp8 bases: what ComfyUI's ops cast them to
            try:
                yield
            finally:
                diffusion_model.dtype = declared
                module.train(was_training)

    def render(self, module, step: int) -> list[str]:
        """Samples every prompt; returns the images' paths relative to the run directory (rank 0 writes them)."""
        s = self.spec
        with self._inference_weights(module), on_the_trainers_device(self.family.patcher):
            latents = [sample_latent(self.family.patcher, positive, self.negative, s.seed + n, steps=s.steps, cfg=s.cfg,
                                     sampler=s.sampler, scheduler=s.scheduler, width=s.width, height=s.height)
                       for n, positive in enumerate(self.positives)]
            if self.write:
                vae = self.vae()
                try:
                    images = vae.decode(torch.cat(latents))
                finally:  # the VAE holds device memory only for its decode
                    forget_loaded(vae.patcher, unload=True)
            else:
                images = None
        names = image_names(step, len(self.positives))
        if self.write:
            from PIL import Image

            from ..cache.files import atomic_write
            (self.run_dir / SAMPLES_DIR).mkdir(exist_ok=True)
            for name, image in zip(names, images.reshape(-1, *images.shape[-3:])):
                with atomic_write(self.run_dir / name) as staged:  # the panel reads samples while they appear
                    Image.fromarray(to_pixels(image)).save(staged.path, format="PNG")
        return names
