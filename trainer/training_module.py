"""What DeepSpeed wraps when the whole model sits in one process: the diffusion model (with its adapter),
whose forward returns the family's training loss."""
from __future__ import annotations

import torch

from .data.batch_mix import loss_parts
from .models import Batch, ModelFamily
from .objectives import batch_loss


class TrainingModule(torch.nn.Module):
    def __init__(self, family: ModelFamily):
        super().__init__()
        self.diffusion_model = family.diffusion_model
        self.family = family

    def forward(self, latents, cond, noise, timesteps, pooled=None, mask=None, sample_weight=None, is_prior=None,
                references=None, text_mask=None, text_extras=None, audio=None, audio_noise=None):
        """The micro-batch's training loss: the mean of its per-sample losses, each masked per latent pixel
        (`mask`) and scaled by its `sample_weight` where given (objectives.batch_loss). With `is_prior` (a run
        with prior images), (loss, batch_mix.loss_parts of the unweighted per-sample losses), kept on the device.
        `references`: the items' reference latents per slot (Batch.references), for a family that takes them;
        `text_mask`, `text_extras`: the text encoder's attention mask and extra outputs (Batch's), where cached;
        `audio`, `audio_noise`: the clips' audio latents and their noise (Batch's), where cached."""
        per_sample = self.family.loss(Batch(latents, cond, pooled, noise, timesteps, mask, references, text_mask,
                                            text_extras, audio, audio_noise),
                                      reduce=False)
        loss = batch_loss(per_sample, sample_weight)
        return loss if is_prior is None else (loss, loss_parts(per_sample, is_prior))
