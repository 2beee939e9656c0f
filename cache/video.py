"""Video clips in a training dataset: video files (decoded with PyAV, which ComfyUI already requires) and folders
of frames. A clip is probed once (frame times, and the display rotation of its first decoded frame: a phone's
portrait clip is turned upright) and cut into items of a frame bucket's length at a chosen frame rate, as
diffusion-pipe does; an item's frames are decoded only when its latent is cached, one frame at a time, each fitted
to the bucket at once, so a clip is never held in memory whole.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".gif", ".mkv")
# how a clip longer than its frame bucket becomes items (diffusion-pipe's video_clip_mode)
CLIP_MODES = ("single_beginning", "single_middle", "multiple_overlapping")
DEFAULT_FRAME_BUCKETS = "1, 17, 33, 49, 65, 81"


class ClipError(ValueError):
    """A clip that cannot be read; the message names the file or folder."""


def parse_frame_buckets(text, field_name: str = "frame_buckets") -> tuple[int, ...]:
    """'1, 17, 33' as sorted distinct frame counts; the error names the field."""
    values = text if isinstance(text, (list, tuple)) else str(text).replace(";", ",").split(",")
    try:
        buckets = sorted({int(str(v).strip()) for v in values if str(v).strip()})
    except ValueError:
        raise ClipError(f"{field_name}: {text!r} is not a list of frame counts (e.g. 1, 17, 33)") from None
    if not buckets or buckets[0] < 1:
        raise ClipError(f"{field_name}: {text!r} needs at least one frame count, each at least 1")
    return tuple(buckets)


def clip_spans(n_frames: int, frame_buckets, mode: str = "single_beginning") -> list[tuple[int, int]]:
    """(first frame, frame count) of each item a clip of n_frames (at the dataset's frame rate) becomes: the
    longest frame bucket that fits, taken from the start, from the middle, or as several evenly spaced, possibly
    overlapping windows that together cover the whole clip. [] when no bucket fits (the clip is too short)."""
    if mode not in CLIP_MODES:
        raise ClipError(f"clip_mode must be one of {CLIP_MODES} (got {mode!r})")
    fitting = [b for b in frame_buckets if b <= n_frames]
    if not fitting:
        return []
    frames = max(fitting)
    if mode == "single_beginning":
        return [(0, frames)]
    if mode == "single_middle":
        return [((n_frames - frames) // 2, frames)]
    count = (n_frames - 1) // frames + 1
    if count == 1:
        return [(0, frames)]
    last = n_frames - frames
    return [(round(i * last / (count - 1)), frames) for i in range(count)]


NO_IMAGES = "no images"
_FRAME_NAME = re.compile(r"^(?P<prefix>.*?)(?P<number>\d+)$")


def frame_sequence(path: str | Path, image_extensions) -> tuple[bool, str]:
    """Whether a subfolder of a dataset is a clip (a folder of frames), and why, for the log. It is when its images
    are one numbered sequence: at least 2, each named a common prefix and a number (0001.png, frame_12.png ...), of
    one file type, the numbers evenly spaced without gaps, and none with a caption file of its own (a frame
    folder's caption is beside the folder). Anything else, a folder of photos kept apart, is read as images."""
    try:
        entries = [e for e in os.scandir(path) if not e.name.startswith(".")]
        images = sorted(e.name for e in entries if Path(e.name).suffix.lower() in image_extensions and e.is_file())
    except OSError as exc:
        return False, f"cannot be listed ({exc.strerror or exc})"
    if len(images) < 2:
        return False, NO_IMAGES if not images else "one image"
    unnumbered = next((n for n in images if not _FRAME_NAME.match(Path(n).stem)), None)
    if unnumbered:
        return False, f"{unnumbered} is not a numbered frame"
    names = [_FRAME_NAME.match(Path(n).stem) for n in images]
    prefixes = sorted({m["prefix"] for m in names})
    if len(prefixes) > 1:
        return False, f"names differ beyond their numbers ({prefixes[0]!r}, {prefixes[1]!r} ...)"
    if len({Path(n).suffix.lower() for n in images}) > 1:
        return False, "images of more than one file type"
    numbers = sorted(int(m["number"]) for m in names)
    steps = {b - a for a, b in zip(numbers, numbers[1:])}
    if len(steps) != 1 or 0 in steps:
        return False, f"numbers {numbers[0]}..{numbers[-1]} are not evenly spaced (gaps or repeats)"
    captions = {Path(e.name).stem for e in entries if e.name.lower().endswith(".txt")}
    captioned = next((n for n in images if Path(n).stem in captions), None)
    if captioned:
        return False, f"{captioned} has a caption file of its own"
    return True, f"{len(images)} frames numbered {numbers[0]}..{numbers[-1]}"


def frame_order(name: str) -> list:
    """Frames in number order whatever the padding (2.png before 10.png), then by name."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def frame_files(folder: str | Path, image_extensions) -> list[str]:
    files = [e for e in os.scandir(folder)
             if not e.name.startswith(".") and Path(e.name).suffix.lower() in image_extensions and e.is_file()]
    return [e.path for e in sorted(files, key=lambda e: frame_order(e.name))]


@dataclass(frozen=True)
class ClipInfo:
    width: int
    height: int
    times: tuple[float, ...]  # presentation time of each source frame, seconds from the first
    frame_s: float  # duration of the last frame (the typical interval between frames)
    first_pts: int = 0  # a video's first presentation timestamp, in time_base units
    time_base: float = 1.0
    # counter-clockwise degrees (0, 90, 180, 270) that turn a decoded frame upright: a phone's portrait clip is
    # stored landscape with a display matrix saying so; width and height above are the upright frame's
    rotation: int = 0

    def frame_count(self, fps: float) -> int:
        """Frames of the clip at `fps` (0: the source's own frames)."""
        if fps <= 0:
            return len(self.times)
        return max(1, math.floor((self.times[-1] + self.frame_s) * fps + 1e-6))

    def source_index(self, k: int, fps: float) -> int:
        """Which source frame is shown at frame k of the clip resampled to fps (frames repeat or drop)."""
        if fps <= 0:
            return k
        return max(0, bisect.bisect_right(self.times, k / fps + 1e-6) - 1)


def probe_clip(path: str | Path, image_extensions=()) -> ClipInfo:
    """Frame size and frame times of a video file (its packets are read, none decoded) or a folder of frames."""
    path = Path(path)
    if path.is_dir():
        files = frame_files(path, image_extensions)
        if not files:
            raise ClipError(f"frame folder {path} holds no images")
        from PIL import Image, ImageOps
        try:
            with Image.open(files[0]) as img:
                width, height = ImageOps.exif_transpose(img).size
        except Exception as exc:
            raise ClipError(f"cannot read frame {files[0]}: {exc.__class__.__name__}: {exc}") from None
        return ClipInfo(width, height, tuple(float(i) for i in range(len(files))), 1.0)  # one frame per 1/fps
    import av
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ClipError(f"video {path} has no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            base = float(stream.time_base)
            pts, rotation = [], None
            for packet in container.demux(stream):
                if packet.pts is not None and packet.size:
                    pts.append(packet.pts)
                    if rotation is None:  # the display matrix reaches PyAV on decoded frames only: decode one
                        rotation = next((upright_rotation(f.rotation) for f in packet.decode()), None)
            if rotation is None and pts:  # a decoder holding its frames back until the end gives them now
                rotation = next((upright_rotation(f.rotation) for f in stream.codec_context.decode(None)), None)
            pts.sort()
            rotation = rotation or 0
            # read while the file is open: a stream's fields after it closes are freed memory (a segfault, seen on
            # clips with an audio track)
            rate = float(stream.average_rate or stream.guessed_rate or 0) or None
    except ClipError:
        raise
    except Exception as exc:  # PyAV raises its own error types for bad files
        raise ClipError(f"cannot read video {path}: {exc.__class__.__name__}: {exc}") from None
    if not pts or not width or not height:
        raise ClipError(f"video {path} has no frames")
    check_frame_pixels(path, width, height)
    if rotation in (90, 270):
        width, height = height, width
    times = tuple((p - pts[0]) * base for p in pts)
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    frame_s = (1.0 / rate) if rate else (sorted(gaps)[len(gaps) // 2] if gaps else 1.0)
    return ClipInfo(width, height, times, frame_s, pts[0], base, rotation)


# a clip resampled to the dataset's fps repeats a source frame at most this many times (a 1 fps slideshow at 16 fps):
# timestamps that claim more are not believed (2 frames 100,000 s apart became 1.6 million items)
MAX_FRAME_REPEAT = 16


def check_frame_pixels(path, width: int, height: int):
    """The image library's decompression-bomb limit, for a video's frames too (PIL refuses the same picture as a
    PNG; a 292 kB GIF of 14000x14000 frames took 3 GB)."""
    from PIL import Image
    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise ClipError(f"video {path}: its {width}x{height} frames exceed the {limit}-pixel limit for images")


def check_frame_count(path, info: "ClipInfo", fps: float) -> int:
    """The clip's frame count at fps, refused naming the clip where its timestamps claim far more frames than the
    file holds."""
    n = info.frame_count(fps)
    held = len(info.times)
    if n > MAX_FRAME_REPEAT * (held + 1):
        raise ClipError(f"clip {path}: its timestamps span {n} frames at {fps:g} fps, but it holds {held} "
                        f"frame(s); re-encode it, or lower fps")
    return n


def upright_rotation(degrees) -> int:
    """A display matrix's counter-clockwise rotation (PyAV's VideoFrame.rotation, -180..180) as 0, 90, 180 or 270,
    as ffmpeg's players round it."""
    return int(round((degrees or 0) / 90.0)) % 4 * 90


def upright(img, rotation: int):
    """A decoded PIL frame turned as its display matrix says (exact quarter turns, no resampling)."""
    from PIL import Image
    turn = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}
    return img.transpose(turn[rotation]) if rotation in turn else img


def _stamp(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=64)
def _probe_unchanged(path: str, image_extensions: tuple, mtime_ns: int, size: int) -> ClipInfo:
    """probe_clip, once per version of a file: the items of one clip (several windows, flipped copies) share it."""
    return probe_clip(path, image_extensions)


def clip_info(path: str | Path, image_extensions=()) -> ClipInfo:
    """probe_clip of the clip as it is now, probed once per version."""
    return _probe_unchanged(str(path), tuple(image_extensions), *_stamp(path))


def clip_rotation(path: str | Path) -> int:
    """The quarter turns a video file's frames get when decoded (ClipInfo.rotation); 0 for a frame folder."""
    return 0 if Path(path).is_dir() else clip_info(path).rotation


def clip_digest(path: str | Path, file_digest, image_extensions) -> str:
    """Content identity of a clip: the video file's digest, or of a frame folder the names and digests of its
    frames (editing one frame changes it)."""
    path = Path(path)
    if not path.is_dir():
        return file_digest(path)
    h = hashlib.sha256(b"frames\x00")
    for f in frame_files(path, image_extensions):
        h.update(f"{Path(f).name}\x00{file_digest(f)}\x00".encode())
    return h.hexdigest()


def load_clip_tensor(path: str, start: int, frames: int, fps: float, fit, image_extensions=(), stats=None):
    """Frames [start, start + frames) of the clip at fps as [frames, H, W, 3] in 0..1. `fit` turns one decoded
    PIL RGB frame into the bucket's pixels (a [H, W, 3] float tensor). Decoding stops after the last frame it
    needs, and only the fitted frames it needs are kept. `stats`, a dict, gets "decoded": frames decoded."""
    import torch
    info = clip_info(path, image_extensions)
    wanted = [info.source_index(k, fps) for k in range(start, start + frames)]
    needed, last = set(wanted), max(wanted)
    fitted: dict[int, torch.Tensor] = {}
    decoded = 0
    path = Path(path)
    if path.is_dir():
        from PIL import Image, ImageOps
        files = frame_files(path, image_extensions)
        for index in sorted(needed):
            try:
                with Image.open(files[index]) as img:
                    fitted[index] = fit(ImageOps.exif_transpose(img))
            except Exception as exc:
                raise ClipError(f"cannot decode frame {files[index]}: {exc.__class__.__name__}: {exc}") from None
            decoded += 1
    else:
        import av
        try:
            with av.open(str(path)) as container:
                stream = container.streams.video[0]
                stream.thread_type = "AUTO"
                if min(needed) > 0:  # to the keyframe before the item's first frame, not through the clip
                    try:
                        container.seek(info.first_pts + round(info.times[min(needed)] / info.time_base),
                                       stream=stream, backward=True)
                    except av.error.FFmpegError:
                        pass  # a format that cannot seek is decoded from its start
                for frame in container.decode(stream):
                    if frame.pts is None:
                        continue
                    decoded += 1
                    index = bisect.bisect_left(info.times, (frame.pts - info.first_pts) * info.time_base - 1e-9)
                    if index in needed:
                        fitted[index] = fit(upright(frame.to_image(), info.rotation))
                    if index >= last:
                        break
        except Exception as exc:
            raise ClipError(f"cannot decode video {path}: {exc.__class__.__name__}: {exc}") from None
    missing = needed - set(fitted)
    if missing:
        raise ClipError(f"clip {path}: frame {min(missing)} could not be decoded")
    if stats is not None:
        stats["decoded"] = decoded
    return torch.stack([fitted[i] for i in wanted])
