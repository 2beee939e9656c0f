"""The persistent cache: SQLite metadata plus one safetensors shard per entry, shared by all datasets and runs.

Entries are keyed by content (see encoding.py). Safety:
- a shard is written to a temporary name, fsynced and renamed before its row is inserted, so a
  row never points at a partial file, whatever kills the writer;
- SQLite in WAL mode with a busy timeout lets several processes fill one cache at once (the key
  is the primary key, so two writers of the same entry end with one valid row);
- every row carries the shard's sha256; a damaged shard is found, dropped and re-encoded.
This module is the only one that knows the layout; the trainer reads shards through the manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST_VERSION = 2
DB_FILE = "cache.sqlite"
SHARDS_DIR = "shards"

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
  key TEXT PRIMARY KEY, kind TEXT NOT NULL, checksum TEXT NOT NULL, bytes INTEGER NOT NULL,
  meta TEXT, created REAL NOT NULL, used REAL NOT NULL);
CREATE TABLE IF NOT EXISTS sources (
  path TEXT PRIMARY KEY, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, digest TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS dataset_entries (dataset TEXT NOT NULL, key TEXT NOT NULL, PRIMARY KEY (dataset, key));
CREATE TABLE IF NOT EXISTS datasets (dataset TEXT PRIMARY KEY, folder TEXT, updated REAL NOT NULL);
"""


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


def entry_path(root: str | Path, kind: str, key: str) -> Path:
    return Path(root) / SHARDS_DIR / kind / key[:2] / f"{key}.safetensors"


@dataclass(frozen=True)
class Entry:
    key: str
    kind: str
    path: Path
    checksum: str


class CacheStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.root / DB_FILE, timeout=60, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self):
        self._db.close()

    # entries -------------------------------------------------------------------------------
    def lookup(self, key: str, verify: bool = True) -> Entry | None:
        """The entry if present and intact; a damaged or missing shard drops the entry (returns None)."""
        row = self._db.execute("SELECT kind, checksum FROM entries WHERE key=?", (key,)).fetchone()
        if row is None:
            return None
        entry = Entry(key, row[0], entry_path(self.root, row[0], key), row[1])
        try:
            intact = entry.path.is_file() and (not verify or file_sha256(entry.path) == entry.checksum)
        except OSError:
            intact = False
        if not intact:
            self._db.execute("DELETE FROM entries WHERE key=? AND checksum=?", (key, entry.checksum))
            return None
        self._db.execute("UPDATE entries SET used=? WHERE key=?", (time.time(), key))
        return entry

    def put(self, kind: str, key: str, tensors: dict, meta: dict | None = None) -> Entry:
        from safetensors.torch import save_file
        path = entry_path(self.root, kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:12]}-", suffix=".partial")
        os.close(fd)
        try:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp,
                      metadata={k: str(v) for k, v in (meta or {}).items()})
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            checksum = file_sha256(tmp)
            size = os.path.getsize(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)  # atomic: readers see the old shard or the new one, never a part
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        now = time.time()
        self._db.execute("INSERT OR REPLACE INTO entries (key, kind, checksum, bytes, meta, created, used) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)", (key, kind, checksum, size, json.dumps(meta or {}), now, now))
        return Entry(key, kind, path, checksum)

    # sources: skip re-hashing files whose size and mtime did not change ---------------------
    def source_digest(self, path: str | Path) -> str:
        path = str(Path(path).resolve())
        st = os.stat(path)
        row = self._db.execute("SELECT size, mtime_ns, digest FROM sources WHERE path=?", (path,)).fetchone()
        if row and row[0] == st.st_size and row[1] == st.st_mtime_ns:
            return row[2]
        digest = file_sha256(path)
        self._db.execute("INSERT OR REPLACE INTO sources (path, size, mtime_ns, digest) VALUES (?, ?, ?, ?)",
                         (path, st.st_size, st.st_mtime_ns, digest))
        return digest

    # datasets: which entries are in use, for pruning ----------------------------------------
    def set_dataset(self, dataset: str, folder: str, keys) -> None:
        keys = sorted(set(keys))
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute("DELETE FROM dataset_entries WHERE dataset=?", (dataset,))
            self._db.executemany("INSERT OR IGNORE INTO dataset_entries (dataset, key) VALUES (?, ?)",
                                 [(dataset, k) for k in keys])
            self._db.execute("INSERT OR REPLACE INTO datasets (dataset, folder, updated) VALUES (?, ?, ?)",
                             (dataset, folder, time.time()))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def stats(self) -> dict:
        entries, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM entries").fetchone()
        by_kind = dict(self._db.execute("SELECT kind, COUNT(*) FROM entries GROUP BY kind").fetchall())
        unused = self._db.execute("SELECT COUNT(*) FROM entries WHERE key NOT IN "
                                  "(SELECT key FROM dataset_entries)").fetchone()[0]
        datasets = [{"dataset": d, "folder": f, "updated": u, "entries": n} for d, f, u, n in self._db.execute(
            "SELECT d.dataset, d.folder, d.updated, COUNT(e.key) FROM datasets d "
            "LEFT JOIN dataset_entries e ON e.dataset = d.dataset GROUP BY d.dataset")]
        return {"root": str(self.root), "entries": entries, "bytes": size, "by_kind": by_kind,
                "unused_entries": unused, "datasets": datasets}

    def prune(self, older_than_s: float = 3600.0) -> dict:
        """Removes entries no dataset uses, shards without a row and leftovers of interrupted writes."""
        removed, freed = 0, 0
        for key, kind, size in self._db.execute(
                "SELECT key, kind, bytes FROM entries WHERE key NOT IN (SELECT key FROM dataset_entries)").fetchall():
            self._db.execute("DELETE FROM entries WHERE key=?", (key,))
            try:
                entry_path(self.root, kind, key).unlink()
            except FileNotFoundError:
                pass
            removed, freed = removed + 1, freed + size
        known = {k for (k,) in self._db.execute("SELECT key FROM entries")}
        now = time.time()
        shards = self.root / SHARDS_DIR
        for path in shards.rglob("*") if shards.is_dir() else ():
            if not path.is_file():
                continue
            stale_tmp = path.name.startswith(".") and now - path.stat().st_mtime > older_than_s
            orphan = path.suffix == ".safetensors" and not path.name.startswith(".") and path.stem not in known
            if stale_tmp or orphan:
                freed += path.stat().st_size
                path.unlink()
                removed += 1
        return {"removed": removed, "freed_bytes": freed}


def write_manifest(path: str | Path, dataset, cache_root: str | Path) -> Path:
    """The trainer's view of a cached dataset: per item its shards (key + checksum) and bucket."""
    path = Path(path)
    manifest = {
        "version": MANIFEST_VERSION,
        "cache_root": str(cache_root),
        "folder": dataset.folder,
        "repeats": dataset.repeats,
        "fields": ["source", "caption", "latent", "latent_sha256", "text", "text_sha256", "width", "height", "flip"],
        "items": [[i.path, i.caption, i.latent, i.latent_sha, i.text, i.text_sha, i.bucket[0], i.bucket[1], i.flip]
                  for i in dataset.items],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, separators=(",", ":")), encoding="utf-8")
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
    if not manifest.get("items"):
        raise ValueError(f"dataset manifest {path} lists no items")
    return manifest


def load_checked(root: str | Path, kind: str, key: str, checksum: str) -> dict:
    """Reads one shard, refusing it unless its bytes match the checksum recorded when it was written."""
    from safetensors.torch import load
    path = entry_path(root, kind, key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"cache shard {path} is missing; run the cache nodes again") from None
    if hashlib.sha256(data).hexdigest() != checksum:
        raise ValueError(f"cache shard {path} is damaged (checksum mismatch); run the cache nodes again")
    return load(data)
