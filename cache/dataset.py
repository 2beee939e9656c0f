"""Training datasets: a folder of images with captions, as paths and text (pixels stay on disk)."""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .buckets import BucketSettings, bucket_for, crop_box
from .files import read_regular_file
from .video import CLIP_MODES, DEFAULT_FRAME_BUCKETS, NO_IMAGES, VIDEO_EXTENSIONS, ClipError, check_frame_count, \
    clip_spans, frame_sequence, parse_frame_buckets, probe_clip

log = logging.getLogger("ingraph_trainer")

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MISSING_CAPTION_ACTIONS = ("error", "use default caption")
# where a loss mask comes from: a greyscale image `name.mask.png` beside `name.png` (white trains, black is
# ignored), the image's own alpha channel, or nowhere. `*.mask.<ext>` files are never training images.
MASK_SOURCES = ("mask files", "alpha channel", "off")
MASK_SUFFIX = ".mask"
ALPHA_MASK = "alpha"  # DatasetItem.mask_source of an item whose mask is its image's alpha channel
DEFAULT_BACKGROUND = (255, 255, 255)  # transparent pixels are composited on this colour (white)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # PIL's 16-bit greyscale PNG modes
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


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
    pixels: str = ""  # how decoding differs from plain 8-bit RGB (pixel_variant); part of the latent's key
    mask_source: str = ""  # path of its mask image, ALPHA_MASK, or "" (no mask: every latent pixel weighs 1)
    # (key, sha) of each cached tag-shuffled variant of the caption (TrainingDataset.caption_variants of them)
    text_variants: tuple[tuple[str, str], ...] = ()
    # a clip item (path: a video file or a folder of frames): `frames` frames from frame `start` of the clip at
    # the dataset's fps; 0 frames: a still image
    frames: int = 0
    start: int = 0
    # reference images (edit models' source image, image-to-video's start image), one path per reference slot,
    # cached in the item's latent shard on its bucket's grid
    references: tuple[str, ...] = ()

    @property
    def is_clip(self) -> bool:
        return self.frames > 0


@dataclass(frozen=True)
class TrainingDataset:
    folder: str
    items: tuple[DatasetItem, ...]
    buckets: BucketSettings
    repeats: int = 1
    skipped_files: tuple[str, ...] = field(default=())
    background: tuple[int, int, int] = DEFAULT_BACKGROUND
    latent_encoder: str = ""  # identity of the VAE its latents were cached with (encoding.vae_identity)
    text_encoder: str = ""  # identity of the text encoder its captions were cached with
    caption_variants: int = 0  # tag-shuffled variants of each caption cached beside it (0: no shuffling)
    keep_tags: int = 0  # leading comma-separated tags that stay in place when the others are shuffled
    caption_dropout: float = 0.0  # share of training samples that see the empty caption instead (the trainer draws)
    empty_text: tuple[str, str] = ()  # (key, sha) of the empty caption's embedding under text_encoder, once cached
    # (fps, clip mode, frame buckets) where the dataset holds clips; () for images only (their identity unchanged)
    video: tuple = ()

    @property
    def fps(self) -> float:
        return float(self.video[0]) if self.video else 0.0

    @property
    def resolution(self) -> int:
        return self.buckets.resolution

    @property
    def identity(self) -> str:
        """The folder and the settings that shape its items (without encoders: see usage_identity)."""
        shaping = [self.folder, self.buckets.as_key(), self.buckets.crop, self.buckets.flip]
        shaping += [list(self.video)] if self.video else []  # images-only datasets keep their identity
        return hashlib.sha256(json.dumps(shaping).encode()).hexdigest()[:24]

    def usage_identity(self, role: str, encoder: str) -> str:
        """Names this dataset's latents ("latent") or captions ("text") for one encoder in the cache's
        bookkeeping, so caches of one folder for two models (an SDXL and a Flux VAE) do not evict each other."""
        return f"{self.identity}/{role}/{encoder}"

    def __len__(self) -> int:
        return len(self.items)

    @property
    def reference_slots(self) -> int:
        """Reference images per item (0: none; every item has as many), as a cached dataset's manifest says it."""
        return max((len(item.references) for item in self.items), default=0)

    @property
    def has_latents(self) -> bool:
        return all(item.latent for item in self.items)

    @property
    def has_text(self) -> bool:
        return all(item.text for item in self.items) and (not self.needs_empty_text or bool(self.empty_text)) \
            and all(len(item.text_variants) == self.caption_variants for item in self.items)

    @property
    def needs_empty_text(self) -> bool:
        return self.caption_dropout > 0

    def cache_keys(self) -> list[str]:
        """Every cache entry this dataset uses (latents with their masks, captions, their shuffled variants and
        the empty caption): what a run manifest pins and what record_usage keeps."""
        keys = [k for item in self.items for k in (item.latent, item.text, *(v for v, _ in item.text_variants)) if k]
        return keys + ([self.empty_text[0]] if self.empty_text else [])

    def require_cached(self, input_name: str = "dataset"):
        """What a node needs before training or evaluating on it; the error names the input and the fix."""
        if not self.has_latents:
            raise DatasetError(f"{input_name}: latents are not cached; connect it through Cache Latents first")
        if not self.has_text:
            raise DatasetError(f"{input_name}: captions are not encoded; connect it through Cache Text Embeddings "
                               "first")

    def with_items(self, items) -> "TrainingDataset":
        return dataclasses.replace(self, items=tuple(items))


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


def caption_file_of(source: Path) -> Path:
    """`name.txt` beside an image, a video file or a folder of frames."""
    return source.parent / f"{source.name}.txt" if source.is_dir() else source.with_suffix(".txt")


MAX_CAPTION_BYTES = 1 << 20  # far beyond any text encoder's context (T5: 512 tokens; LLM encoders a few thousand)


def _read_caption(image: Path, prefix: str, missing: str, default_caption: str) -> str:
    caption_file = caption_file_of(image)
    try:
        # utf-8-sig: editors on Windows start files with a byte-order mark that must not reach the caption
        text = read_regular_file(caption_file, MAX_CAPTION_BYTES).decode("utf-8-sig").strip()
    except FileNotFoundError:
        if os.path.islink(caption_file):
            raise DatasetError(f"caption file {shown(caption_file)} is a broken symlink") from None
        if missing == "error":
            raise DatasetError(
                f"image {shown(image)} has no caption file {shown(caption_file.name)}; add one, or set "
                f"'missing_caption' to 'use default caption'") from None
        text = default_caption.strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise DatasetError(f"cannot read caption file {shown(caption_file)}: {reason}") from None
    return f"{prefix}{text}" if prefix else text


def _check_image(path: Path, background=DEFAULT_BACKGROUND) -> tuple[tuple[int, int], str]:
    """Size of the image (after EXIF rotation) and its pixel_variant; raises naming the file if it cannot be
    read."""
    from PIL import Image
    try:
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            size = img.size
            orientation = img.getexif().get(0x0112, 1)
            variant = pixel_variant(img, background)
    except Exception as exc:  # PIL raises many types for bad files
        raise DatasetError(f"cannot read image {shown(path)}: {exc.__class__.__name__}: {exc}") from None
    return ((size[1], size[0]) if orientation in (5, 6, 7, 8) else size), variant


def _listed_file(entry) -> bool:
    """Whether a folder entry is a regular file (following symlinks). A dataset file (image or caption) whose
    name is not valid UTF-8, or that is a symlink loop or a broken symlink, is an error naming it."""
    suffix = Path(entry.name).suffix.lower()
    relevant = suffix in IMAGE_EXTENSIONS or suffix in VIDEO_EXTENSIONS or suffix == ".txt"
    if relevant:
        try:
            entry.name.encode("utf-8")
        except UnicodeEncodeError:
            raise DatasetError(f"file name {shown(entry.path)} is not valid UTF-8; rename the file") from None
    try:
        is_file = entry.is_file()
        if not is_file and relevant and entry.is_symlink():
            os.stat(entry.path)  # raises for a broken link
    except OSError as exc:
        if not relevant:
            return False
        reason = "a symlink loop" if exc.errno == errno.ELOOP else (
            "a broken symlink" if isinstance(exc, FileNotFoundError) else exc.strerror or str(exc))
        raise DatasetError(f"cannot read {shown(entry.path)}: {reason}") from None
    return is_file


def _mask_stem(name: str) -> str | None:
    """The image stem a mask file belongs to ('cat' for 'cat.mask.png'), or None if the name is no mask file."""
    path = Path(name)
    if path.suffix.lower() not in IMAGE_EXTENSIONS or not path.stem.lower().endswith(MASK_SUFFIX):
        return None
    return path.stem[:-len(MASK_SUFFIX)]


def shuffled_caption(caption: str, variant: int, keep_tags: int = 0) -> str:
    """Tag-shuffled variant `variant` of a comma-separated caption: the first `keep_tags` tags stay in place,
    the others are shuffled by a generator seeded with the caption and the variant number, so a variant's
    text (and so its cache key) is the same on every run and machine."""
    import random
    tags = [tag.strip() for tag in caption.split(",")]
    tags = [tag for tag in tags if tag]
    kept, rest = tags[:keep_tags], tags[keep_tags:]
    seed = int.from_bytes(hashlib.sha256(f"{variant}\x00{caption}".encode()).digest()[:8], "big")
    random.Random(seed).shuffle(rest)
    return ", ".join(kept + rest)


def caption_variants_of(caption: str, count: int, keep_tags: int = 0) -> list[str]:
    return [shuffled_caption(caption, n, keep_tags) for n in range(count)]


def scan_image_folder(folder: str | Path, *, resolution: int | None = None, buckets: BucketSettings | None = None,
                      repeats: int = 1, caption_prefix: str = "", missing_caption: str = "error",
                      default_caption: str = "", background=DEFAULT_BACKGROUND, masks: str = "mask files",
                      caption_variants: int = 0, keep_tags: int = 0,
                      caption_dropout: float = 0.0, frame_buckets=DEFAULT_FRAME_BUCKETS, fps: float = 16.0,
                      clip_mode: str = "single_beginning", reference_folder: str | Path | None = None
                      ) -> TrainingDataset:
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
    if masks not in MASK_SOURCES:
        raise DatasetError(f"masks must be one of {MASK_SOURCES} (got {masks!r})")
    if caption_variants < 0 or keep_tags < 0:
        raise DatasetError(f"caption_variants and keep_tags must be 0 or more (got {caption_variants}, {keep_tags})")
    if not 0.0 <= caption_dropout < 1.0:
        raise DatasetError(f"caption_dropout must be in [0, 1) (got {caption_dropout})")
    if resolution < 64 or resolution % 8:
        raise DatasetError(f"resolution must be a multiple of 8, at least 64 (got {resolution})")
    if buckets.enabled and not (64 <= buckets.min_side <= buckets.max_side):
        raise DatasetError(f"min_side ({buckets.min_side}) must be at least 64 and at most max_side "
                           f"({buckets.max_side})")

    if isinstance(background, str):
        background = parse_background(background)
    try:
        frame_counts = parse_frame_buckets(frame_buckets)
    except ClipError as exc:
        raise DatasetError(str(exc)) from None
    if clip_mode not in CLIP_MODES:
        raise DatasetError(f"clip_mode must be one of {CLIP_MODES} (got {clip_mode!r})")
    if fps < 0:
        raise DatasetError(f"fps must be 0 (the source's own frame rate) or more (got {fps})")
    images, clips, skipped, mask_files, reference_files = [], [], [], {}, {}
    reference_dir = os.path.realpath(reference_folder) if reference_folder else None
    visited = {os.path.realpath(folder)}  # a symlink back up the tree is read once
    subfolders = {True: [], False: []}  # read as a clip / as images, with why (for the log)

    def walk(current: Path):
        try:
            entries = sorted(os.scandir(current), key=lambda e: e.name)
        except OSError as exc:
            raise DatasetError(f"cannot read folder {shown(current)}: {exc.strerror or exc}") from None
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if _is_dir(entry):
                real = os.path.realpath(entry.path)
                if real == reference_dir or real in visited:
                    continue
                visited.add(real)
                is_clip, why = frame_sequence(entry.path, IMAGE_EXTENSIONS)
                if why != NO_IMAGES:
                    subfolders[is_clip].append(f"{Path(os.path.relpath(entry.path, folder)).as_posix()} ({why})")
                if is_clip:
                    clips.append(Path(entry.path))  # a folder of frames
                else:  # a folder of images (and clips) kept apart: its items, matched by name inside it
                    walk(Path(entry.path))
                continue
            if not _listed_file(entry):
                continue
            suffix = Path(entry.name).suffix.lower()
            mask_of, reference_of = _mask_stem(entry.name), _reference_stem(entry.name)
            if mask_of is not None:
                mask_of = match_key(folder, Path(entry.path), mask_of)
                if mask_of in mask_files:
                    raise DatasetError(f"image {shown(mask_of)} has two mask files, "
                                       f"{shown(mask_files[mask_of].name)} and {shown(entry.name)}; keep one")
                mask_files[mask_of] = Path(entry.path)
            elif reference_of is not None:
                _add_reference(reference_files, (match_key(folder, Path(entry.path), reference_of[0]),
                                                 reference_of[1]), Path(entry.path))
            elif suffix in IMAGE_EXTENSIONS:
                images.append(Path(entry.path))
            elif suffix in VIDEO_EXTENSIONS:
                clips.append(Path(entry.path))
            elif suffix != ".txt":
                skipped.append(Path(os.path.relpath(entry.path, folder)).as_posix())
    walk(folder)
    if reference_folder:
        _scan_reference_folder(Path(reference_folder), reference_files)
    if not images and not clips:
        raise DatasetError(f"image folder {folder} contains no images ({', '.join(IMAGE_EXTENSIONS)}) or videos "
                           f"({', '.join(VIDEO_EXTENSIONS)}, folders of frames)")
    if skipped:
        log.info("InGraph Trainer: ignored %d non-image file(s) in %s: %s", len(skipped), folder,
                 ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
    for is_clip, read in subfolders.items():  # what each subfolder was taken for, and why
        if read:
            log.info("InGraph Trainer: %d subfolder(s) of %s read as %s: %s", len(read), folder,
                     "clips (folders of frames, in frame-number order)" if is_clip else
                     "folders of images (not one numbered frame sequence)",
                     "; ".join(read[:10]) + (" ..." if len(read) > 10 else ""))

    keys = {source: match_key(folder, source, source_stem(source)) for source in images + clips}
    unmatched = sorted(name for name in mask_files if name not in set(keys.values()))
    if unmatched:
        log.info("InGraph Trainer: ignored %d mask file(s) without an image in %s: %s", len(unmatched), folder,
                 ", ".join(mask_files[n].name for n in unmatched[:10]))
    sources = sorted(images + clips, key=lambda p: keys[p])
    references = _references_per_source(sources, keys, reference_files)

    items = []
    for image in images:
        (width, height), pixels = _check_image(image, background)
        caption = _read_caption(image, caption_prefix, missing_caption, default_caption)
        bucket = bucket_for(width, height, buckets)
        mask = _mask_source(image, (width, height), masks, mask_files.get(keys[image]), pixels)
        refs = references[image]
        items.append(DatasetItem(str(image), caption, bucket, pixels=pixels, mask_source=mask, references=refs))
        if buckets.flip:
            items.append(DatasetItem(str(image), caption, bucket, flip=True, pixels=pixels, mask_source=mask,
                                     references=refs))
    too_short = []
    for clip in clips:
        try:
            info = probe_clip(clip, IMAGE_EXTENSIONS)
            n_frames = check_frame_count(clip, info, clip_rate(clip, fps))
        except ClipError as exc:
            raise DatasetError(str(exc)) from None
        # a clip's mask is one image for all its frames (name.mask.png, the frame size); videos have no alpha
        mask = _mask_source(clip, (info.width, info.height), masks, mask_files.get(keys[clip]), "") \
            if masks == "mask files" else ""
        spans = clip_spans(n_frames, frame_counts, clip_mode)
        if not spans:
            too_short.append(clip.name)
            continue
        caption = _read_caption(clip, caption_prefix, missing_caption, default_caption)
        bucket = bucket_for(info.width, info.height, buckets)
        for flip in (False, True) if buckets.flip else (False,):
            items += [DatasetItem(str(clip), caption, bucket, flip=flip, frames=frames, start=start,
                                  references=references[clip], mask_source=mask) for start, frames in spans]
    if too_short:
        log.info("InGraph Trainer: ignored %d clip(s) shorter than the shortest frame bucket (%d) in %s: %s",
                 len(too_short), frame_counts[0], folder, ", ".join(too_short[:10]))
        skipped += too_short
    if not items:
        raise DatasetError(f"image folder {folder}: every clip is shorter than the shortest frame bucket "
                           f"({frame_counts[0]} frames); add 1 to frame_buckets or lower fps")
    video = (float(fps), clip_mode, list(frame_counts)) if clips else ()
    return TrainingDataset(str(folder), tuple(items), buckets, repeats, tuple(skipped), tuple(background),
                           caption_variants=caption_variants, keep_tags=keep_tags, caption_dropout=caption_dropout,
                           video=video)


# reference images: `name.ref.png` (slot 1), `name.ref2.png` (slot 2) ... beside `name.png` (or a clip), or in a
# second folder matched by name (there `name.png` is slot 1). Reference files are never training images.
_REFERENCE = re.compile(r"^(?P<stem>.+)\.ref(?P<slot>[1-9][0-9]*)?$", re.IGNORECASE)


def _reference_stem(name: str) -> tuple[str, int] | None:
    path = Path(name)
    match = _REFERENCE.match(path.stem) if path.suffix.lower() in IMAGE_EXTENSIONS else None
    return (match["stem"], int(match["slot"] or 1)) if match else None


def _add_reference(found: dict, of: tuple[str, int], path: Path):
    stem, slot = of
    if (stem, slot) in found:
        raise DatasetError(f"{shown(stem)} has two reference images for slot {slot}, "
                           f"{shown(found[stem, slot])} and {shown(path)}; keep one")
    found[stem, slot] = path


def _is_dir(entry: os.DirEntry) -> bool:
    """A folder (a frame folder's candidate); a symlink loop is not, and _listed_file names it."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _scan_reference_folder(folder: Path, found: dict, top: Path | None = None, visited: set | None = None):
    """Reference images matched by name: `cat.png` (or `cat.ref2.png` for slot 2) is `cat.png`'s; in a subfolder,
    the item's of the dataset's subfolder of that name."""
    top = top or folder
    visited = visited if visited is not None else {os.path.realpath(folder)}
    if not folder.is_dir():
        raise DatasetError(f"reference_folder: {shown(folder)} is not a folder")
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if _is_dir(entry):
            if os.path.realpath(entry.path) not in visited:  # a symlink back up the tree is read once
                visited.add(os.path.realpath(entry.path))
                _scan_reference_folder(Path(entry.path), found, top, visited)
            continue
        if not _listed_file(entry):
            continue
        path = Path(entry.name)
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            continue
        stem, slot = _reference_stem(entry.name) or (path.stem, 1)
        _add_reference(found, (match_key(top, Path(entry.path), stem), slot), Path(entry.path))


def _references_per_source(sources: list[Path], keys: dict[Path, str], found: dict) -> dict[Path, tuple[str, ...]]:
    """Each source's reference paths by slot (`keys`: each source's match_key). Every item of one dataset has the
    same number of reference slots (a batch stacks them slot by slot), numbered from 1 without gaps; the error
    names a file at fault."""
    out = {}
    for source in sources:
        stem = keys[source]
        slots = sorted(slot for s, slot in found if s == stem)
        if slots != list(range(1, len(slots) + 1)):
            raise DatasetError(f"{shown(source)}: its reference images are numbered {slots}; number them from 1 "
                               f"without gaps ({stem}.ref.png, {stem}.ref2.png, ...)")
        for n in slots:
            _check_image(found[stem, n])
        out[source] = tuple(str(found[stem, n]) for n in slots)
    stems = set(keys.values())
    orphans = sorted({str(path) for (stem, _), path in found.items() if stem not in stems})
    if orphans:
        log.info("InGraph Trainer: ignored %d reference image(s) without an item: %s", len(orphans),
                 ", ".join(shown(o) for o in orphans[:10]))
    counts = {len(refs) for refs in out.values()}
    if len(counts) > 1:
        most = max(len(r) for r in out.values())
        short = next(source for source, refs in out.items() if len(refs) < most)
        raise DatasetError(f"{shown(short)} has {len(out[short])} reference image(s) but other items have {most}; "
                           f"every item of a dataset needs the same number (add {keys[short]}.ref.png beside it, "
                           "or move the items without references to another dataset)")
    return out


def _mask_source(image: Path, size: tuple[int, int], masks: str, mask_file: Path | None, pixels: str) -> str:
    """The item's mask_source under the dataset's `masks` setting; a mask file must be a readable image of the
    same size as its image (after EXIF rotation), since it is cropped and resized with the same geometry."""
    if masks == "alpha channel":
        return ALPHA_MASK if "alpha" in pixels else ""
    if masks == "off" or mask_file is None:
        return ""
    mask_size, _ = _check_image(mask_file)
    if mask_size != size:
        raise DatasetError(f"mask {shown(mask_file)} is {mask_size[0]}x{mask_size[1]} but its image "
                           f"{shown(image.name)} is {size[0]}x{size[1]}; a mask must have its image's size")
    return str(mask_file)


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


def match_key(top: Path, path: Path, stem: str) -> str:
    """What a file is matched to its item by: its stem (an image's, a mask's or reference's item's) with the
    subfolder it lies in, so `a/cat.mask.png` is `a/cat.png`'s and not `b/cat.png`'s."""
    folder = Path(os.path.relpath(path.parent, top)).as_posix()
    return stem if folder == "." else f"{folder}/{stem}"


def source_stem(source: Path) -> str:
    """The name an item's caption, mask and references are matched by: a file's stem, a frame folder's name."""
    return source.stem if source.is_file() else source.name


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


def prior_problems(dataset: TrainingDataset, prior: TrainingDataset, input_name: str = "prior_dataset") -> list[str]:
    """Why a prior (regularisation) dataset cannot be mixed into this one's batches: both must be cached with
    the same VAE and text encoder, or the model would learn from latents and embeddings of another model."""
    problems = []
    if prior.latent_encoder != dataset.latent_encoder:
        problems.append(f"{input_name}: its latents were cached with another VAE than the training images'")
    if prior.text_encoder != dataset.text_encoder:
        problems.append(f"{input_name}: its captions were encoded with another text encoder than the training "
                        "images'")
    return problems
