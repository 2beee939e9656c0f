"""The on-disk cache of latents and text embeddings, and the manifest the trainer reads.

This is the one module that knows the cache layout: one safetensors file per entry, named by a
content key, written to a temporary name and renamed so that a crash never leaves a partial
entry under a real name. Keys cover the source bytes and every parameter that changes the tensor.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

MANIFEST_VERSION = 1


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


class CacheStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / f"{key}.safetensors"

    def get_path(self, kind: str, key: str) -> Path | None:
        path = self._path(kind, key)
        return path if path.is_file() else None

    def put(self, kind: str, key: str, tensors: dict, metadata: dict | None = None) -> Path:
        from safetensors.torch import save_file
        path = self._path(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}-", suffix=".tmp")
        os.close(fd)
        try:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp,
                      metadata={k: str(v) for k, v in (metadata or {}).items()})
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path


def load_entry(path: str | Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))


def write_manifest(path: str | Path, dataset) -> Path:
    """The trainer's view of a cached dataset: per item its latent and text entries, and repeats."""
    path = Path(path)
    manifest = {
        "version": MANIFEST_VERSION,
        "folder": dataset.folder,
        "resolution": dataset.resolution,
        "repeats": dataset.repeats,
        "items": [{"source": i.path, "caption": i.caption, "latent": i.latent, "text": i.text} for i in dataset.items],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return path


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
    for n, item in enumerate(manifest.get("items", [])):
        for kind in ("latent", "text"):
            if not item.get(kind) or not Path(item[kind]).is_file():
                raise ValueError(f"dataset manifest {path}: item {n} ({item.get('source')}) has no cached {kind}")
    if not manifest.get("items"):
        raise ValueError(f"dataset manifest {path} lists no items")
    return manifest
