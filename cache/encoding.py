"""Encode a dataset's images (graph's VAE) and captions (graph's CLIP) into the cache, once per item.

A latent's key covers the image bytes, its bucket, crop, flip and the VAE's weights; a text
embedding's key covers the caption and the text encoder's weights and settings. Unchanged items are
never encoded again; any change re-encodes exactly what depends on it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .dataset import TrainingDataset, load_image_tensor
from .store import CacheStore, content_key, fingerprint_state_dict

LATENT_FORMAT = 2
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


def latent_key(digest: str, item, dataset: TrainingDataset, encoder: str) -> str:
    # `pixels` only where decoding is more than a plain 8-bit conversion (16-bit, transparency on a chosen
    # background): every other image keeps the key it had before those were handled
    extra = {"pixels": item.pixels} if item.pixels else {}
    return content_key(kind="latent", format=LATENT_FORMAT, source=digest, bucket=list(item.bucket),
                       crop=dataset.buckets.crop, flip=item.flip, encoder=encoder, **extra)


def encode_latents(dataset: TrainingDataset, vae, store: CacheStore, progress: Progress | None = None):
    """Returns (dataset with latent entries, encoded count, reused count)."""
    encoder = vae_identity(vae)
    items, encoded, reused = [], 0, 0
    for n, item in enumerate(dataset.items):
        digest = store.source_digest(item.path)
        key = latent_key(digest, item, dataset, encoder)
        entry = store.lookup(key)
        if entry is None:
            pixels = load_image_tensor(item.path, item.bucket, dataset.buckets.crop, item.flip, digest,
                                       dataset.background)
            latent = vae.encode(pixels[:, :, :, :3])
            entry = store.put("latent", key, {"latent": latent[0].float()},
                              {"source": item.path, "bucket": f"{item.bucket[0]}x{item.bucket[1]}"})
            encoded += 1
        else:
            reused += 1
        items.append(dataclasses.replace(item, latent=entry.key, latent_sha=entry.checksum))
        if progress:
            progress(n + 1, len(dataset.items))
    return dataclasses.replace(dataset, items=tuple(items), latent_encoder=encoder), encoded, reused


def encode_text(dataset: TrainingDataset, clip, store: CacheStore, progress: Progress | None = None):
    """Returns (dataset with text entries, encoded count, reused count)."""
    encoder = clip_identity(clip)
    items, encoded, reused, done = [], 0, 0, {}
    for n, item in enumerate(dataset.items):
        key = content_key(kind="text", format=TEXT_FORMAT, caption=item.caption, encoder=encoder)
        if key not in done:
            entry = store.lookup(key)
            if entry is None:
                out = clip.encode_from_tokens(clip.tokenize(item.caption), return_pooled=True, return_dict=True)
                tensors = {"cond": out["cond"][0].float()}
                if out.get("pooled_output") is not None:
                    tensors["pooled"] = out["pooled_output"][0].float()
                entry = store.put("text", key, tensors, {"caption": item.caption})
                encoded += 1
            else:
                reused += 1
            done[key] = entry
        items.append(dataclasses.replace(item, text=done[key].key, text_sha=done[key].checksum))
        if progress:
            progress(n + 1, len(dataset.items))
    return dataclasses.replace(dataset, items=tuple(items), text_encoder=encoder), encoded, reused


def record_usage(dataset: TrainingDataset, store: CacheStore):
    """Marks the entries this dataset uses, so that pruning keeps them: its latents under its VAE's identity,
    its captions under its text encoder's, so caching the same folder for another model evicts nothing."""
    for role, encoder, keys in (("latent", dataset.latent_encoder, [i.latent for i in dataset.items if i.latent]),
                                ("text", dataset.text_encoder, [i.text for i in dataset.items if i.text])):
        if encoder and keys:
            # replaces the record of versions that named a dataset without its encoders
            store.set_dataset(dataset.usage_identity(role, encoder), dataset.folder, keys,
                              replaces=(dataset.identity,))
