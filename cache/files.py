"""Atomic file writes: a reader sees the old file or the new one, never a part, and two writers never share a
temporary file. One helper for everything the pack writes where others read (adapters, models, cache shards,
manifests, checkpoint marks, samples). Standard library only: the ComfyUI side and the trainer both import it.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TEMP_SUFFIX = ".partial"
FILE_MODE = 0o644  # mkstemp's 0600 would hide a file from a ComfyUI (or a tool) run by another user


def fsync_dir(path: str | Path):
    """Makes a rename in `path` durable."""
    if os.name == "nt":  # a folder cannot be opened for fsync there; NTFS orders its metadata itself
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StagedFile:
    """A temporary file beside its target. Write to `.path`; `commit()` makes it the target, `discard()` drops it."""

    def __init__(self, target: Path, prefix: str | None, mode: int):
        self.target = target
        self.mode = mode
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=prefix if prefix is not None else f".{target.stem}-",
                                   suffix=TEMP_SUFFIX)  # a unique name: concurrent writers never collide
        os.close(fd)
        self.path = Path(tmp)
        self.done = False

    def commit(self):
        with open(self.path, "rb+") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.chmod(self.path, self.mode)
        from ..trainer.os_support import replace_file  # the platform module (no import of the pack's own)
        replace_file(self.path, self.target)
        self.done = True
        fsync_dir(self.target.parent)

    def discard(self):
        self.path.unlink(missing_ok=True)
        self.done = True


@contextlib.contextmanager
def atomic_write(path: str | Path, prefix: str | None = None, mode: int = FILE_MODE):
    """Yields a StagedFile whose `.path` the caller writes; on a clean exit it replaces `path` (unless the caller
    committed or discarded it already), on an error it is removed and `path` is left as it was.
    `prefix`: the temporary name's start (default `.<stem>-`; it ends in `-XXXXXXXX.partial`)."""
    path = Path(path)
    staged = StagedFile(path, prefix, mode)
    try:
        yield staged
        if not staged.done:
            staged.commit()
    finally:
        staged.path.unlink(missing_ok=True)  # gone already when committed


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = FILE_MODE) -> Path:
    with atomic_write(path, mode=mode) as staged:
        staged.path.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str, mode: int = FILE_MODE) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """A small file's bytes, read only if it is a regular file (never a FIFO or device, which would block or never
    end: opened non-blocking, checked before reading) of at most `limit` bytes. OSError naming why otherwise
    (FileNotFoundError where it is absent)."""
    import stat
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(0, "not a regular file")
        if info.st_size > limit:
            raise OSError(0, f"{info.st_size} bytes; at most {limit}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:  # grew since the check
            raise OSError(0, f"more than {limit} bytes")
        return data
    finally:
        os.close(fd)


SAFETENSORS_HEADER_LIMIT = 100 * 2**20  # the safetensors format's own bound on a header


def safetensors_header(path: str | Path) -> dict | None:
    """A safetensors file's header (tensor name -> dtype, shape, offsets; "__metadata__"), read without a tensor;
    None where the file cannot be read or is not one."""
    import json
    import struct
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > SAFETENSORS_HEADER_LIMIT:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return None
    return header if isinstance(header, dict) else None
