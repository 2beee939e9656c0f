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
    by_bucket: dict[tuple[int, int], list[int]] = {}
    for i in indices:
        by_bucket.setdefault(dataset.buckets[i], []).append(i)
    chunks = [group[s:s + batch_size] for _, group in sorted(by_bucket.items()) for s in range(0, len(group), batch_size)]
    for q in quantiles:
        losses = []
        for chunk in chunks:
            latents, cond = dataset.batch(chunk)
            noise = torch.stack([torch.randn(latents.shape[1:], generator=_generator(seed, 3, i)) for i in chunk])
            batch = Batch(latents=latents.to(device), cond=cond.to(device),
                          pooled=None, noise=noise.to(device), timesteps=torch.full((len(chunk),), q, device=device))
            losses.append(module.family.loss(batch, reduce=False).float().cpu())
        per_quantile[f"{q:g}"] = torch.cat(losses).mean().item()
    module.train(was_training)
    return {"loss": sum(per_quantile.values()) / len(per_quantile), "quantiles": per_quantile}
