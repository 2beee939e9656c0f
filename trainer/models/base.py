"""The model-family interface: what the trainer needs from each family of diffusion model."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    latents: torch.Tensor  # raw VAE latents, as cached (family applies its latent format)
    cond: torch.Tensor  # text-encoder hidden states
    pooled: torch.Tensor | None
    noise: torch.Tensor
    timesteps: torch.Tensor  # in [0, 1): where on the noise schedule each sample lies


class ModelFamily:
    """One family of diffusion model: load, adapter targets, layers, loss.

    `base_model` is ComfyUI's BaseModel (model code and schedule from ComfyUI itself);
    subclasses say which modules take adapters and how a batch becomes a loss.
    """

    name = "base"
    base_model_version = "unknown"  # kohya ss_base_model_version
    target_patterns: dict[str, tuple[str, ...]] = {}

    def __init__(self, base_model, prediction: str, patcher=None):
        self.base_model = base_model
        self.patcher = patcher  # ComfyUI's ModelPatcher around base_model (what its samplers take)
        self.diffusion_model = base_model.diffusion_model
        self.prediction = prediction

    @classmethod
    def matches(cls, base_model) -> bool:
        raise NotImplementedError

    def adapter_targets(self, preset: str) -> list[str]:
        """Names (relative to the diffusion model) of the linear layers an adapter preset trains."""
        linear = [n for n, m in self.diffusion_model.named_modules() if isinstance(m, torch.nn.Linear)]
        if preset == "all_linear":
            return linear
        patterns = [re.compile(p) for p in self.target_patterns[preset]]
        return [n for n in linear if any(p.search(n) for p in patterns)]

    def checkpoint_blocks(self) -> list[torch.nn.Module]:
        """Blocks whose activations gradient checkpointing recomputes."""
        raise NotImplementedError

    def prepare_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.base_model.process_latent_in(latents)

    def loss(self, batch: Batch, reduce: bool = True) -> torch.Tensor:
        raise NotImplementedError
