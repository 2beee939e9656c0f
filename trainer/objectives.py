"""Loss functions and per-timestep weightings shared by every model family (pure torch, no ComfyUI).

The training loss may be weighted (min-SNR) or robust (Huber); evaluation always uses the plain
MSE so that evaluation numbers stay comparable across runs with different objectives.
"""
from __future__ import annotations

import torch

from .spec import LOSSES, TIMESTEP_SAMPLING



def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor, kind: str = "mse",
                    huber_delta: float = 0.1, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over every dimension but the batch; with a mask (loss weights per latent pixel, broadcast over
    channels and frames, in the prediction's layout), the mask-weighted mean: sum(w * err) / sum(w). A pixel of
    weight 0 adds nothing to the loss or its gradient; a fully masked sample has loss 0."""
    prediction, target = prediction.float(), target.float()
    if kind == "huber":
        err = torch.nn.functional.huber_loss(prediction, target, reduction="none", delta=huber_delta)
    elif kind == "mse":
        err = (prediction - target).pow(2)
    else:
        raise ValueError(f"train.loss: {kind!r} is not one of {LOSSES}")
    dims = tuple(range(1, err.dim()))
    if mask is None:
        return err.mean(dim=dims)
    weight = mask.to(err.device, torch.float32).expand_as(err)
    return (err * weight).sum(dim=dims) / weight.sum(dim=dims).clamp_min(torch.finfo(torch.float32).tiny)


def batch_loss(per_sample: torch.Tensor, sample_weight: torch.Tensor | None = None) -> torch.Tensor:
    """A micro-batch's loss from its per-sample losses: the mean, each sample scaled by its weight (prior images'
    prior_weight, 1 for training images; kohya's prior_loss_weight), so every micro-batch of the global batch
    counts alike whichever rank holds the prior items."""
    if sample_weight is None:
        return per_sample.mean()
    return (per_sample * sample_weight.to(per_sample.device, per_sample.dtype)).mean()


def min_snr_weight(snr: torch.Tensor, gamma: float, prediction: str) -> torch.Tensor:
    """Min-SNR-gamma weighting (Hang et al. 2023), per sample: the target's own loss scale is undone.

    epsilon: min(SNR, gamma) / SNR; v-prediction (CogVideoX's too: its error is (SNR + 1) times the clean
    latent's, as plain v's): min(SNR, gamma) / (SNR + 1);
    flow matching (velocity target): min(SNR, gamma) / (SNR + 1) as well."""
    clipped = torch.minimum(snr, torch.full_like(snr, gamma))
    if prediction == "epsilon":
        return clipped / snr
    return clipped / (snr + 1.0)



def training_timesteps(uniform: torch.Tensor, kind: str = "uniform", mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Places on the noise schedule for training, from uniform draws in [0, 1).

    logit_normal (SD3): sigmoid of a normal(mean, std) variable, by its inverse CDF, so the same uniform
    draws (seeded by step) give the same timesteps on any layout and after a resume."""
    if kind == "uniform":
        return uniform
    if kind != "logit_normal":
        raise ValueError(f"train.timestep_sampling: {kind!r} is not one of {TIMESTEP_SAMPLING}")
    u = uniform.double().clamp(1e-6, 1.0 - 1e-6)
    return torch.sigmoid(mean + std * (2.0 ** 0.5) * torch.erfinv(2.0 * u - 1.0)).to(uniform.dtype)
