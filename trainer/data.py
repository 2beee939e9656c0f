"""The cached dataset as the trainer sees it, and a data order that depends only on (seed, step).

Because the order and the noise of step s are pure functions of the seed and s, a resumed run and
a run on a different number of processes draw exactly the same samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.store import load_entry, read_manifest


@dataclass
class CachedDataset:
    latents: list[torch.Tensor]
    conds: list[torch.Tensor]
    pooled: list[torch.Tensor | None]
    sources: list[str]
    resolution: int

    def __len__(self):
        return len(self.latents)


def load_cached_dataset(manifest_path: str) -> CachedDataset:
    manifest = read_manifest(manifest_path)
    latents, conds, pooled, sources = [], [], [], []
    text_cache: dict[str, dict] = {}
    for item in manifest["items"]:
        latent = load_entry(item["latent"])["latent"]
        text = text_cache.setdefault(item["text"], load_entry(item["text"]))
        for _ in range(int(manifest.get("repeats", 1))):
            latents.append(latent)
            conds.append(text["cond"])
            pooled.append(text.get("pooled"))
            sources.append(item["source"])
    shapes = {tuple(t.shape) for t in latents}
    if len(shapes) != 1:
        raise ValueError(f"{manifest_path}: latents of different sizes {sorted(shapes)}; use one resolution")
    return CachedDataset(latents, conds, pooled, sources, int(manifest.get("resolution", 0)))


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


class StepSampler:
    """Indices, noise and timesteps for each optimizer step's global batch (all ranks, all micro-batches)."""

    def __init__(self, dataset_size: int, global_batch: int, seed: int, shuffle: bool = True):
        self.n = dataset_size
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self._epoch_orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._epoch_orders:
            self._epoch_orders = {epoch: torch.randperm(self.n, generator=_generator(self.seed, 1, epoch)).tolist()
                                  if self.shuffle else list(range(self.n))}
        return self._epoch_orders[epoch]

    def indices(self, step: int) -> list[int]:
        start = step * self.global_batch
        out = []
        for pos in range(start, start + self.global_batch):
            out.append(self._order(pos // self.n)[pos % self.n])
        return out

    def noise_and_timesteps(self, step: int, latent_shape: tuple[int, ...]):
        g = _generator(self.seed, 2, step)
        noise = torch.randn((self.global_batch, *latent_shape), generator=g)
        timesteps = torch.rand((self.global_batch,), generator=g)
        return noise, timesteps
