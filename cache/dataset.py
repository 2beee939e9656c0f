"""Training datasets: a folder of images with captions, as paths and text (pixels stay on disk)."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("ingraph_trainer")

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MISSING_CAPTION_ACTIONS = ("error", "use default caption")


class DatasetError(ValueError):
    """A dataset that cannot be trained on; the message names the folder or file at fault."""


@dataclass(frozen=True)
class DatasetItem:
    path: str
    caption: str
    latent: str = ""  # cache entry holding this item's latent, once cached
    text: str = ""  # cache entry holding this caption's embedding, once cached


@dataclass(frozen=True)
class TrainingDataset:
    folder: str
    items: tuple[DatasetItem, ...]
    resolution: int
    repeats: int = 1
    skipped_files: tuple[str, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.items)

    @property
    def has_latents(self) -> bool:
        return all(item.latent for item in self.items)

    @property
    def has_text(self) -> bool:
        return all(item.text for item in self.items)

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


def _check_image(path: Path):
    from PIL import Image
    try:
        with Image.open(path) as img:
            img.verify()
    except Exception as exc:  # PIL raises many types for bad files
        raise DatasetError(f"cannot read image {path}: {exc.__class__.__name__}: {exc}") from None


def scan_image_folder(folder: str | Path, *, resolution: int, repeats: int = 1, caption_prefix: str = "",
                      missing_caption: str = "error", default_caption: str = "") -> TrainingDataset:
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
        _check_image(image)
        items.append(DatasetItem(str(image), _read_caption(image, caption_prefix, missing_caption, default_caption)))
    return TrainingDataset(str(folder), tuple(items), resolution, repeats, tuple(skipped))


def load_image_tensor(path: str, resolution: int):
    """Decode, resize the short side to `resolution`, centre-crop to a square: [1, H, W, 3] in 0..1."""
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as img:
            img = ImageOps.exif_transpose(img).convert("RGB")
    except Exception as exc:
        raise DatasetError(f"cannot decode image {path}: {exc.__class__.__name__}: {exc}") from None
    scale = resolution / min(img.size)
    size = (max(resolution, round(img.width * scale)), max(resolution, round(img.height * scale)))
    if size != img.size:
        img = img.resize(size, Image.Resampling.LANCZOS)
    left, top = (img.width - resolution) // 2, (img.height - resolution) // 2
    img = img.crop((left, top, left + resolution, top + resolution))
    array = np.asarray(img, dtype=np.float32) / 255.0
    return torch.from_numpy(array).unsqueeze(0)


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
