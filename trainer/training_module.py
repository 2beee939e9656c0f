"""What DeepSpeed wraps when the whole model sits in one process: the diffusion model (with its adapter),
whose forward returns the family's training loss."""
from __future__ import annotations

import torch

from .models import Batch, ModelFamily


class TrainingModule(torch.nn.Module):
    def __init__(self, family: ModelFamily):
        super().__init__()
        self.diffusion_model = family.diffusion_model
        self.family = family

    def forward(self, latents, cond, noise, timesteps, pooled=None):
        return self.family.loss(Batch(latents, cond, pooled, noise, timesteps))
