"""Media files the video tests write: clips whose frame k is a flat grey of a known level, frame folders and flat
images, all SIDE pixels square (tests/unit/test_video_data.py, tests/comfyui/test_video_families.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

SIDE = 64


def write_video(path: Path, frames: int, fps: int = 8, codec: str = "libx264", keyframe_every: int = 250):
    """A clip whose frame k is a flat grey of level 5 * k (so a decoded frame says which frame it is)."""
    import av
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width = stream.height = SIDE
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "0", "preset": "ultrafast", "g": str(keyframe_every),
                              "keyint_min": str(keyframe_every)}
        for k in range(frames):
            image = np.full((SIDE, SIDE, 3), 5 * k, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_frames(folder: Path, frames: int, level=lambda k: 10 * k):
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(frames):
        Image.new("RGB", (SIDE, SIDE), (level(k),) * 3).save(folder / f"{k:04d}.png")
    return folder


def write_image(path: Path, level: int = 128, size=(SIDE, SIDE)):
    from PIL import Image
    Image.new("RGB", size, (level, 40, 200)).save(path)
    return path


def cached_captions(folder: Path, clip, captions: dict[str, str], latent_channels: int = 4):
    """A folder of one flat image per caption (name.png beside name.txt), cached through the pack's own Cache Latents
    (a stand-in VAE giving zero latents: the captions are the point) and Cache Text Embeddings with `clip`:
    (the graph's dataset, the trainer's CachedDataset of its manifest, item index by name)."""
    import torch
    from PIL import Image

    from ingraph_trainer.cache.buckets import BucketSettings
    from ingraph_trainer.cache.encoding import encode_latents, encode_text
    from ingraph_trainer.cache.folder_scan import scan_image_folder
    from ingraph_trainer.cache.store import CacheStore, write_manifest
    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    images = folder / "images"
    images.mkdir()
    for name, caption in captions.items():
        Image.new("RGB", (SIDE, SIDE), (90, 40, 200)).save(images / f"{name}.png")
        (images / f"{name}.txt").write_text(caption)

    class VAE:
        def get_sd(self):
            return {"w": torch.ones(1)}

        def encode(self, pixels):
            return torch.zeros(1, latent_channels, 8, 8)
    store = CacheStore(folder / "cache")
    dataset = scan_image_folder(images, buckets=BucketSettings(resolution=SIDE, enabled=False))
    dataset, _, _ = encode_latents(dataset, VAE(), store)
    dataset, _, _ = encode_text(dataset, clip, store)
    store.close()
    cached = load_cached_dataset(str(write_manifest(folder / "m.json", dataset, folder / "cache")))
    return dataset, cached, {Path(s).stem: i for i, s in enumerate(cached.sources)}
