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
        self.loss_kind, self.huber_delta, self.min_snr_gamma = "mse", 0.1, 0.0  # see set_objective
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

    def set_objective(self, loss: str = "mse", huber_delta: float = 0.1, min_snr_gamma: float = 0.0):
        """How the training loss is computed; evaluation (weighted=False) always uses plain MSE."""
        self.loss_kind, self.huber_delta, self.min_snr_gamma = loss, huber_delta, min_snr_gamma

    def training_loss(self, prediction: torch.Tensor, target: torch.Tensor, snr: torch.Tensor,
                      weighted: bool) -> torch.Tensor:
        """Per-sample loss: the configured objective when `weighted`, else plain MSE."""
        from ..objectives import min_snr_weight, per_sample_loss
        if not weighted:
            return per_sample_loss(prediction, target)
        loss = per_sample_loss(prediction, target, self.loss_kind, self.huber_delta)
        if self.min_snr_gamma > 0:
            loss = loss * min_snr_weight(snr.float(), self.min_snr_gamma, self.prediction)
        return loss

    def loss(self, batch: Batch, reduce: bool = True, weighted: bool = True) -> torch.Tensor:
        raise NotImplementedError
