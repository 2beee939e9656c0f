"""What a dataset item's source files become as pixels: images decoded upright in 8-bit RGB (16-bit greyscale
scaled, transparency composited on a background colour), fitted to the item's bucket (cover, crop, mirror) with the
same geometry for its mask and its references, clips' frames, and masks as per-latent-pixel weights."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .buckets import crop_box
from .video import ClipError

if TYPE_CHECKING:
    import torch

    from .dataset import DatasetItem

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
ALPHA_MASK = "alpha"  # DatasetItem.mask_source of an item whose mask is its image's alpha channel
DEFAULT_BACKGROUND = (255, 255, 255)  # transparent pixels are composited on this colour (white)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # PIL's 16-bit greyscale PNG modes
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


class DatasetError(ValueError):
    """A dataset that cannot be trained on; the message names the folder or file at fault."""


def shown(path) -> str:
    """A path as messages show it: bytes that are not UTF-8 appear as escapes, never as lone surrogates
    (which would break a JSON or websocket message carrying the error)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def parse_background(colour: str, field_name: str = "transparent_background") -> tuple[int, int, int]:
    """'#rrggbb', '#rgb' or a colour name ('white') as an RGB triple; the error names the field."""
    from PIL import ImageColor
    try:
        rgb = ImageColor.getrgb(str(colour).strip())
    except ValueError:
        raise DatasetError(f"{field_name}: {colour!r} is not a colour (use #rrggbb, e.g. #ffffff, or a name "
                           "such as white)") from None
    return tuple(int(c) for c in rgb[:3])


def _has_alpha(img) -> bool:
    if img.mode in SIXTEEN_BIT_MODES:
        return False  # decoded as greyscale; a 16-bit tRNS colour is not supported
    return img.mode in ALPHA_MODES or "transparency" in img.info


def pixel_variant(img, background=DEFAULT_BACKGROUND) -> str:
    """How to_rgb decodes this image beyond a plain 8-bit conversion ('' if not at all): part of the latent's
    cache key, so images whose decoding does not depend on it keep the keys they always had."""
    parts = []
    if img.mode in SIXTEEN_BIT_MODES:
        parts.append("16bit")
    if _has_alpha(img):
        parts.append("alpha on #%02x%02x%02x" % tuple(background))
    return "+".join(parts)


def to_rgb(img, background=DEFAULT_BACKGROUND):
    """8-bit RGB of a decoded image: 16-bit greyscale scaled (not clipped) to 0..255, transparent pixels
    (alpha channel, palette or colour-key transparency) composited on the background colour."""
    from PIL import Image
    if img.mode in SIXTEEN_BIT_MODES:
        import numpy as np
        values = np.clip(np.asarray(img, dtype=np.float64), 0, 65535) / 257.0
        return Image.fromarray(np.round(values).astype(np.uint8), "L").convert("RGB")
    if _has_alpha(img):
        rgba = img.convert("RGBA")
        base = Image.new("RGBA", rgba.size, tuple(background) + (255,))
        return Image.alpha_composite(base, rgba).convert("RGB")
    return img.convert("RGB")


def _fit_to_bucket(img, bucket: tuple[int, int], crop: str, flip: bool, crop_seed: str, resample):
    """The geometry every pixel map of an item goes through (the image and its mask alike): resize to cover
    the bucket, crop to it (centre, or a random box fixed by crop_seed), optionally mirror."""
    from PIL import ImageOps
    size, (left, top) = crop_box(img.width, img.height, bucket, crop, crop_seed)
    if size != img.size:
        img = img.resize(size, resample)
    img = img.crop((left, top, left + bucket[0], top + bucket[1]))
    return ImageOps.mirror(img) if flip else img


def _decode_rgb(path: str, background=DEFAULT_BACKGROUND):
    """An image file as upright 8-bit RGB (EXIF rotation applied, see to_rgb); the error names the file."""
    from PIL import Image, ImageOps
    try:
        with Image.open(path) as img:
            return to_rgb(ImageOps.exif_transpose(img), background)
    except Exception as exc:
        raise DatasetError(f"cannot decode image {shown(path)}: {exc.__class__.__name__}: {exc}") from None


def _as_tensor(img):
    import numpy as np
    import torch
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).unsqueeze(0)


def load_image_tensor(path: str, bucket: tuple[int, int] | int, crop: str = "center", flip: bool = False,
                      digest: str = "", background=DEFAULT_BACKGROUND):
    """Decode (EXIF rotation applied, see to_rgb), resize to cover the bucket, crop to it (centre or a fixed
    random box), optionally mirror: [1, H, W, 3] in 0..1."""
    from PIL import Image
    if isinstance(bucket, int):
        bucket = (bucket, bucket)
    img = _fit_to_bucket(_decode_rgb(path, background), bucket, crop, flip, digest or path, Image.Resampling.LANCZOS)
    return _as_tensor(img)


def source_size(item: DatasetItem) -> tuple[int, int]:
    """(width, height) of an item's source as it is decoded (EXIF or display rotation applied)."""
    if item.is_clip:
        from .video import clip_info
        info = clip_info(item.path, IMAGE_EXTENSIONS)
        return info.width, info.height
    from PIL import Image
    try:
        with Image.open(item.path) as img:
            size, orientation = img.size, img.getexif().get(0x0112, 1)
    except Exception as exc:
        raise DatasetError(f"cannot read image {shown(item.path)}: {exc.__class__.__name__}: {exc}") from None
    return (size[1], size[0]) if orientation in (5, 6, 7, 8) else size


def load_reference_tensor(path: str, item: DatasetItem, crop: str, target_digest: str,
                          background=DEFAULT_BACKGROUND):
    """A reference image with its target's geometry, so an edit pair (or a clip and its start image) stays aligned
    pixel for pixel: fitted to the target's bucket with the target's crop box (a random crop seeded by the
    target's digest, as the target's is) and flip: [1, H, W, 3] in 0..1. A reference of the target's aspect at
    another size is first resized to the target's size (the same region, whatever the rounding); one of another
    aspect keeps its proportions (covers the bucket, cropped at the same place), as ComfyUI never stretches one."""
    from PIL import Image
    img = _decode_rgb(path, background)
    width, height = source_size(item)
    if img.size != (width, height) and abs(img.height * width / img.width - height) <= 1:
        img = img.resize((width, height), Image.Resampling.LANCZOS)
    return _as_tensor(_fit_to_bucket(img, item.bucket, crop, item.flip, target_digest or item.path,
                                     Image.Resampling.LANCZOS))


def clip_rate(clip: str | Path, fps: float) -> float:
    """The rate a clip is resampled to: the dataset's fps, or 0 (frame by frame) for a folder of frames, whose
    frames are taken as already at the dataset's rate."""
    return 0.0 if Path(clip).is_dir() else float(fps)


def clip_fps(item: DatasetItem, fps: float) -> float:
    """The rate a clip item's frames are read at (clip_rate of its source)."""
    return clip_rate(item.path, fps)


def load_clip_item_tensor(item: DatasetItem, fps: float, crop: str = "center", digest: str = "",
                          background=DEFAULT_BACKGROUND, stats=None):
    """A clip item's frames, each decoded, resized to cover the bucket, cropped (one box for every frame: a
    random crop is fixed by the clip's digest) and optionally mirrored: [frames, H, W, 3] in 0..1."""
    import numpy as np
    import torch
    from PIL import Image
    from .video import load_clip_tensor

    def fit(img):
        img = _fit_to_bucket(to_rgb(img, background), item.bucket, crop, item.flip, digest or item.path,
                             Image.Resampling.LANCZOS)
        return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)
    try:
        return load_clip_tensor(item.path, item.start, item.frames, clip_fps(item, fps), fit, IMAGE_EXTENSIONS,
                                stats)
    except ClipError as exc:
        raise DatasetError(str(exc)) from None


def load_mask_tensor(image_path: str, mask_source: str, bucket: tuple[int, int] | int, crop: str = "center",
                     flip: bool = False, digest: str = ""):
    """An item's loss mask at its bucket's pixel size, [H, W] in 0..1 (1 trains, 0 is ignored): the mask file
    as greyscale (transparent pixels count as black), or the image's alpha channel; cropped, resized and
    mirrored exactly as load_image_tensor treats the image (`digest` is the image's, which fixes a random crop).
    Resized with a box filter: a weight map is averaged, never sharpened (Lanczos would ring past 0..1)."""
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    if isinstance(bucket, int):
        bucket = (bucket, bucket)
    source = image_path if mask_source == ALPHA_MASK else mask_source
    try:
        with Image.open(source) as img:
            img = ImageOps.exif_transpose(img)
            grey = img.convert("RGBA").getchannel("A") if mask_source == ALPHA_MASK else \
                to_rgb(img, (0, 0, 0)).convert("L")
    except Exception as exc:
        raise DatasetError(f"cannot decode mask {shown(source)}: {exc.__class__.__name__}: {exc}") from None
    grey = _fit_to_bucket(grey, bucket, crop, flip, digest or image_path, Image.Resampling.BOX)
    return torch.from_numpy(np.asarray(grey, dtype=np.float32) / 255.0)


def mask_to_latent_grid(mask, latent_shape) -> "torch.Tensor":
    """The pixel mask [H, W] as per-latent-pixel weights shaped to broadcast over one latent (channels and any
    frame axis of size 1): each latent pixel summarises a (H/h x W/w) patch of the image, so its weight is the
    area average of the mask over that patch (a patch half inside the mask weighs 0.5)."""
    import torch
    h, w = latent_shape[-2:]
    grid = torch.nn.functional.adaptive_avg_pool2d(mask.float()[None, None], (h, w))[0, 0]
    return grid.reshape((1,) * (len(latent_shape) - 2) + (h, w)).clamp(0.0, 1.0)
