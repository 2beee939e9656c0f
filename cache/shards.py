"""The cache's entries as their readers see them: content keys, where an entry's shard lives (refusing any kind or
key this pack never writes, and any path that resolves outside the shards folder), a shard read back verified
against its checksum, and a run's manifest read. store.py writes and prunes them; the trainer reads through here."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

MANIFEST_VERSION = 2
SHARDS_DIR = "shards"
KINDS = ("latent", "text")  # every kind this pack writes; anything else in a row is hostile or foreign
SHARD_SUFFIX = ".safetensors"
ENTRY_KEY = re.compile(r"[0-9a-f]{64}")


def content_key(**parts) -> str:
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def fingerprint_state_dict(state_dict) -> str:
    """Stable identity of a set of weights, computed from names, shapes and a strided sample of values."""
    import torch
    h = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 1024)
        sample = flat[::step][:1024].to(device="cpu", dtype=torch.float32).contiguous()
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def valid_entry_id(kind, key) -> bool:
    """True for a kind this pack writes and a key that is a sha256 hex digest (what content_key makes)."""
    return isinstance(kind, str) and kind in KINDS and isinstance(key, str) and ENTRY_KEY.fullmatch(key) is not None


def entry_path(root: str | Path, kind: str, key: str) -> Path:
    """Where the shard of (kind, key) lives; refuses anything that is not a kind and key this pack writes."""
    if not valid_entry_id(kind, key):
        raise ValueError(f"invalid cache entry (kind {kind!r}, key {key!r}): not one this pack writes")
    return Path(root) / SHARDS_DIR / kind / key[:2] / f"{key}{SHARD_SUFFIX}"


def resolves_inside(path: Path, folder: Path) -> bool:
    """True if path, with every symlink resolved, lies inside folder (itself resolved)."""
    try:
        return Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(folder)))
    except (OSError, ValueError):
        return False


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"dataset manifest {path} not found") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"dataset manifest {path} is not valid JSON: {exc}") from None
    if manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"dataset manifest {path}: unsupported version {manifest.get('version')}")
    if not manifest.get("items"):
        raise ValueError(f"dataset manifest {path} lists no items")
    return manifest


def _shard_path(root: str | Path, kind: str, key: str) -> Path:
    path = entry_path(root, kind, key)
    if not resolves_inside(path.parent, Path(root) / SHARDS_DIR):
        raise ValueError(f"invalid cache entry (kind {kind!r}, key {key!r}): its shard folder {path.parent} "
                         "resolves outside the cache's shards folder")
    return path


def shard_shapes(root: str | Path, kind: str, key: str) -> dict[str, tuple[int, ...]]:
    """The shapes of a shard's tensors, by name, from its header alone (what a start-up check reads of every entry;
    the tensors themselves are read verified, by load_checked, when used)."""
    from safetensors import safe_open
    path = _shard_path(root, kind, key)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except FileNotFoundError:
        raise ValueError(f"cache shard {path} is missing; run the cache nodes again") from None
    except Exception as exc:  # a damaged header: safetensors' own error types
        raise ValueError(f"cache shard {path} is damaged ({exc}); run the cache nodes again") from None


def load_checked(root: str | Path, kind: str, key: str, checksum: str) -> dict:
    """Reads one shard, refusing it unless its bytes match the checksum recorded when it was written."""
    from safetensors.torch import load
    path = _shard_path(root, kind, key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"cache shard {path} is missing; run the cache nodes again") from None
    if hashlib.sha256(data).hexdigest() != checksum:
        raise ValueError(f"cache shard {path} is damaged (checksum mismatch); run the cache nodes again")
    return load(data)
