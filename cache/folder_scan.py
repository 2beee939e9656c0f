"""Reading a folder into a TrainingDataset: images, clips and frame folders with their captions, masks and
reference images, each checked (an error names the file at fault), put in buckets, and repeated."""
from __future__ import annotations

import errno
import logging
import os
import re
from pathlib import Path

from .buckets import BucketSettings, bucket_for
from .captions import MISSING_CAPTION_ACTIONS, read_caption
from .dataset import DatasetItem, TrainingDataset
from .pixels import (ALPHA_MASK, DEFAULT_BACKGROUND, IMAGE_EXTENSIONS, DatasetError, clip_rate, parse_background,
                     pixel_variant, shown)
from .video import CLIP_MODES, DEFAULT_FRAME_BUCKETS, NO_IMAGES, VIDEO_EXTENSIONS, ClipError, check_frame_count, \
    clip_spans, frame_sequence, parse_frame_buckets, probe_clip

log = logging.getLogger("ingraph_trainer")

# where a loss mask comes from: a greyscale image `name.mask.png` beside `name.png` (white trains, black is
# ignored), the image's own alpha channel, or nowhere. `*.mask.<ext>` files are never training images.
MASK_SOURCES = ("mask files", "alpha channel", "off")
MASK_SUFFIX = ".mask"


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
        caption = read_caption(image, caption_prefix, missing_caption, default_caption)
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
        caption = read_caption(clip, caption_prefix, missing_caption, default_caption)
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


def match_key(top: Path, path: Path, stem: str) -> str:
    """What a file is matched to its item by: its stem (an image's, a mask's or reference's item's) with the
    subfolder it lies in, so `a/cat.mask.png` is `a/cat.png`'s and not `b/cat.png`'s."""
    folder = Path(os.path.relpath(path.parent, top)).as_posix()
    return stem if folder == "." else f"{folder}/{stem}"


def source_stem(source: Path) -> str:
    """The name an item's caption, mask and references are matched by: a file's stem, a frame folder's name."""
    return source.stem if source.is_file() else source.name
