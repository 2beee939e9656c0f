"""Captions: the text file beside each source (`name.txt`), read safely, and its tag-shuffled variants."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .files import read_regular_file
from .pixels import DatasetError, shown

MISSING_CAPTION_ACTIONS = ("error", "use default caption")


def caption_file_of(source: Path) -> Path:
    """`name.txt` beside an image, a video file or a folder of frames."""
    return source.parent / f"{source.name}.txt" if source.is_dir() else source.with_suffix(".txt")


MAX_CAPTION_BYTES = 1 << 20  # far beyond any text encoder's context (T5: 512 tokens; LLM encoders a few thousand)


def read_caption(image: Path, prefix: str, missing: str, default_caption: str) -> str:
    """The caption of a source (`prefix` put before it); a missing file is refused or given `default_caption`
    (`missing`), and the error names the file."""
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
