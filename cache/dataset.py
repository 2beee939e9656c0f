"""Training datasets: a folder of images with captions, as paths and text (pixels stay on disk)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from .buckets import BucketSettings, bucket_for, crop_box

log = logging.getLogger("ingraph_trainer")

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MISSING_CAPTION_ACTIONS = ("error", "use default caption")


class DatasetError(ValueError):
    """A dataset that cannot be trained on; the message names the folder or file at fault."""


@dataclass(frozen=True)
class DatasetItem:
    path: str
    caption: str
    bucket: tuple[int, int] = (0, 0)  # (width, height) the image is resized and cropped to
    flip: bool = False
    latent: str = ""  # cache key of this item's latent, once cached
    latent_sha: str = ""
    text: str = ""  # cache key of this caption's embedding, once cached
    text_sha: str = ""


@dataclass(frozen=True)
class TrainingDataset:
    folder: str
    items: tuple[DatasetItem, ...]
    buckets: BucketSettings
    repeats: int = 1
    skipped_files: tuple[str, ...] = field(default=())

    @property
    def resolution(self) -> int:
        return self.buckets.resolution

    @property
    def identity(self) -> str:
        """Names this dataset in the cache's bookkeeping (which entries are in use)."""
        return hashlib.sha256(json.dumps([self.folder, self.buckets.as_key(), self.buckets.crop,
                                          self.buckets.flip]).encode()).hexdigest()[:24]

    def __len__(self) -> int:
        return len(self.items)

    @property
    def has_latents(self) -> bool:
        return all(item.latent for item in self.items)

    @property
    def has_text(self) -> bool:
        return all(item.text for item in self.items)

    def require_cached(self, input_name: str = "dataset"):
        """What a node needs before training or evaluating on it; the error names the input and the fix."""
        if not self.has_latents:
            raise DatasetError(f"{input_name}: latents are not cached; connect it through Cache Latents first")
        if not self.has_text:
            raise DatasetError(f"{input_name}: captions are not encoded; connect it through Cache Text Embeddings "
                               "first")

    def with_items(self, items) -> "TrainingDataset":
        return dataclasses.replace(self, items=tuple(items))


def _read_caption(image: Path, prefix: str, missing: str, default_caption: str) -> str:
    caption_file = image.with_suffix(".txt")
    if caption_file.is_file():
        try:
            text = caption_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise DatasetError(f"cannot read caption file {caption_file}: {exc}") from None
    elif missing == "error":
        raise DatasetError(
            f"image {image} has no caption file {caption_file.name}; add one, or set "
            f"'missing_caption' to 'use default caption'")
    else:
        text = default_caption.strip()
    return f"{prefix}{text}" if prefix else text


def _check_image(path: Path) -> tuple[int, int]:
    """Size of the image (after EXIF rotation); raises naming the file if it cannot be read."""
    from PIL import Image
    try:
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            size = img.size
            orientation = img.getexif().get(0x0112, 1)
    except Exception as exc:  # PIL raises many types for bad files
        raise DatasetError(f"cannot read image {path}: {exc.__class__.__name__}: {exc}") from None
    return (size[1], size[0]) if orientation in (5, 6, 7, 8) else size


def scan_image_folder(folder: str | Path, *, resolution: int | None = None, buckets: BucketSettings | None = None,
                      repeats: int = 1, caption_prefix: str = "", missing_caption: str = "error",
                      default_caption: str = "") -> TrainingDataset:
    if buckets is None:  # one square size, as before bucketing existed
        buckets = BucketSettings(resolution=resolution or 512, enabled=False)
    resolution = buckets.resolution
    folder = Path(folder)
    if not folder.exists():
        raise DatasetError(f"image folder {folder} does not exist")
    if not folder.is_dir():
        raise DatasetError(f"{folder} is not a folder")
    if missing_caption not in MISSING_CAPTION_ACTIONS:
        raise DatasetError(f"missing_caption must be one of {MISSING_CAPTION_ACTIONS}")
    if repeats < 1:
        raise DatasetError(f"repeats must be at least 1 (got {repeats})")
    if resolution < 64 or resolution % 8:
        raise DatasetError(f"resolution must be a multiple of 8, at least 64 (got {resolution})")
    if buckets.enabled and not (64 <= buckets.min_side <= buckets.max_side):
        raise DatasetError(f"min_side ({buckets.min_side}) must be at least 64 and at most max_side "
                           f"({buckets.max_side})")

    images, skipped = [], []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not entry.is_file() or entry.name.startswith("."):
            continue
        suffix = Path(entry.name).suffix.lower()
        if suffix in IMAGE_EXTENSIONS:
            images.append(Path(entry.path))
        elif suffix != ".txt":
            skipped.append(entry.name)
    if not images:
        raise DatasetError(f"image folder {folder} contains no images ({', '.join(IMAGE_EXTENSIONS)})")
    if skipped:
        log.info("InGraph Trainer: ignored %d non-image file(s) in %s: %s", len(skipped), folder,
                 ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""))

    items = []
    for image in images:
        width, height = _check_image(image)
        caption = _read_caption(image, caption_prefix, missing_caption, default_caption)
        bucket = bucket_for(width, height, buckets)
        items.append(DatasetItem(str(image), caption, bucket))
        if buckets.flip:
            items.append(DatasetItem(str(image), caption, bucket, flip=True))
    return TrainingDataset(str(folder), tuple(items), buckets, repeats, tuple(skipped))


def load_image_tensor(path: str, bucket: tuple[int, int] | int, crop: str = "center", flip: bool = False,
                      digest: str = ""):
    """Decode, resize to cover the bucket, crop to it (centre or a fixed random box), optionally mirror:
    [1, H, W, 3] in 0..1."""
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    if isinstance(bucket, int):
        bucket = (bucket, bucket)
    try:
        with Image.open(path) as img:
            img = ImageOps.exif_transpose(img).convert("RGB")
    except Exception as exc:
        raise DatasetError(f"cannot decode image {path}: {exc.__class__.__name__}: {exc}") from None
    size, (left, top) = crop_box(img.width, img.height, bucket, crop, digest or path)
    if size != img.size:
        img = img.resize(size, Image.Resampling.LANCZOS)
    img = img.crop((left, top, left + bucket[0], top + bucket[1]))
    if flip:
        img = ImageOps.mirror(img)
    array = np.asarray(img, dtype=np.float32) / 255.0
    return torch.from_numpy(array).unsqueeze(0)
