"""Loss at fixed timestep quantiles with fixed noise (diffusion-pipe's evaluation), deterministic."""
from __future__ import annotations

import torch

from .data import CachedDataset, _generator
from .models import Batch


@torch.no_grad()
def evaluate(module, dataset: CachedDataset, indices: list[int], quantiles: list[float], seed: int,
             batch_size: int, device) -> dict:
    was_training = module.training
    module.eval()
    per_quantile = {}
    for q in quantiles:
        losses = []
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            latents = torch.stack([dataset.latents[i] for i in chunk])
            noise = torch.stack([torch.randn(dataset.latents[i].shape, generator=_generator(seed, 3, i)) for i in chunk])
            batch = Batch(latents=latents.to(device), cond=torch.stack([dataset.conds[i] for i in chunk]).to(device),
                          pooled=None, noise=noise.to(device), timesteps=torch.full((len(chunk),), q, device=device))
            losses.append(module.family.loss(batch, reduce=False).float().cpu())
        per_quantile[f"{q:g}"] = torch.cat(losses).mean().item()
    module.train(was_training)
    return {"loss": sum(per_quantile.values()) / len(per_quantile), "quantiles": per_quantile}
