"""Encode a dataset's images (graph's VAE) and captions (graph's CLIP) into the cache, once per item."""
from __future__ import annotations

from typing import Callable

from .dataset import TrainingDataset, file_digest, load_image_tensor
from .store import CacheStore, content_key, fingerprint_state_dict

LATENT_FORMAT = 1
TEXT_FORMAT = 1

Progress = Callable[[int, int], None]


def vae_identity(vae) -> str:
    return fingerprint_state_dict(vae.get_sd())


def clip_identity(clip) -> str:
    ident = {"weights": fingerprint_state_dict(clip.get_sd()), "layer_idx": getattr(clip, "layer_idx", None)}
    patches = getattr(getattr(clip, "patcher", None), "patches", {}) or {}
    if patches:  # a LoRA applied to the text encoder changes every embedding
        ident["patches"] = fingerprint_state_dict(
            {f"{k}/{n}": p[1] for k, plist in patches.items() for n, p in enumerate(plist) if hasattr(p[1], "shape")})
        ident["strengths"] = sorted((k, [float(p[0]) for p in plist]) for k, plist in patches.items())
    return content_key(**ident)[:32]


def encode_latents(dataset: TrainingDataset, vae, store: CacheStore, progress: Progress | None = None):
    """Returns (dataset with latent entries, encoded count, reused count)."""
    encoder = vae_identity(vae)
    items, encoded, reused = [], 0, 0
    for n, item in enumerate(dataset.items):
        key = content_key(kind="latent", format=LATENT_FORMAT, source=file_digest(item.path),
                          resolution=dataset.resolution, crop="center", flip=False, encoder=encoder)
        path = store.get_path("latents", key)
        if path is None:
            pixels = load_image_tensor(item.path, dataset.resolution)
            latent = vae.encode(pixels[:, :, :, :3])
            path = store.put("latents", key, {"latent": latent[0].float()}, {"source": item.path})
            encoded += 1
        else:
            reused += 1
        items.append(_replace(item, latent=str(path)))
        if progress:
            progress(n + 1, len(dataset.items))
    return dataset.with_items(items), encoded, reused


def encode_text(dataset: TrainingDataset, clip, store: CacheStore, progress: Progress | None = None):
    """Returns (dataset with text entries, encoded count, reused count)."""
    encoder = clip_identity(clip)
    items, encoded, reused, done = [], 0, 0, {}
    for n, item in enumerate(dataset.items):
        key = content_key(kind="text", format=TEXT_FORMAT, caption=item.caption, encoder=encoder)
        if key not in done:
            path = store.get_path("text", key)
            if path is None:
                out = clip.encode_from_tokens(clip.tokenize(item.caption), return_pooled=True, return_dict=True)
                tensors = {"cond": out["cond"][0].float()}
                if out.get("pooled_output") is not None:
                    tensors["pooled"] = out["pooled_output"][0].float()
                path = store.put("text", key, tensors, {"caption": item.caption})
                encoded += 1
            else:
                reused += 1
            done[key] = path
        items.append(_replace(item, text=str(done[key])))
        if progress:
            progress(n + 1, len(dataset.items))
    return dataset.with_items(items), encoded, reused


def _replace(item, **changes):
    import dataclasses
    return dataclasses.replace(item, **changes)
