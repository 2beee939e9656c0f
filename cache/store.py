"""The persistent cache: SQLite metadata plus one safetensors shard per entry, shared by all datasets and runs.

Entries are keyed by content (see encoding.py). Safety:
- a shard is written to a temporary name and fsynced outside any lock; then, inside one SQLite write
  transaction (BEGIN IMMEDIATE, the cross-process mutex), it is renamed into place and its row inserted.
  Prune does all its work inside the same kind of transaction, so it never sees a shard between its
  rename and its row, and a writer never re-inserts a row whose shard prune is unlinking;
- the first writer of a key wins: a later put() of a key whose row vouches for an intact shard discards
  its own file and returns the existing entry (two servers sharing one cache folder agree on one shard);
- every row carries the shard's sha256; a damaged shard is found, dropped and re-encoded;
- rows are untrusted input (the cache usually lives under ComfyUI's output folder, which clients can
  write to): a row whose kind or key is not one this module writes is dropped without touching any
  file, and every shard path is checked to stay inside the shards folder;
- prune keeps what is in use: entries of a recorded dataset, entries pinned by a run manifest that
  still exists, and every entry created or used since the oldest live caching pass began.
Only this module and shards.py know the layout; the trainer reads shards through the manifest (shards.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .files import atomic_write, atomic_write_text
from .shards import (ENTRY_KEY, KINDS, MANIFEST_VERSION, SHARD_SUFFIX, SHARDS_DIR, entry_path, file_sha256,
                     resolves_inside, valid_entry_id)

DB_FILE = "cache.sqlite"
RUN_PIN_PREFIX = "run:"  # pseudo-dataset holding the keys of one run manifest while that file exists
PASS_HEARTBEAT_S = 10.0  # a live caching pass refreshes its heartbeat at least this often while it works
PASS_STALE_S = 900.0  # a pass whose heartbeat is older than this is treated as dead (crashed, other host)
DB_BUSY_S = 60.0  # how long opening or writing the database waits for other processes' locks
ORPHAN_GRACE_S = 600.0  # shard files without a row, and run pins without their manifest, are kept this long

_TEMP_NAME = re.compile(r"\.[0-9a-f]{12}-[A-Za-z0-9_]+\.partial")

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
  key TEXT PRIMARY KEY, kind TEXT NOT NULL, checksum TEXT NOT NULL, bytes INTEGER NOT NULL,
  meta TEXT, created REAL NOT NULL, used REAL NOT NULL);
CREATE TABLE IF NOT EXISTS sources (
  path TEXT PRIMARY KEY, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, digest TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS dataset_entries (dataset TEXT NOT NULL, key TEXT NOT NULL, PRIMARY KEY (dataset, key));
CREATE TABLE IF NOT EXISTS datasets (dataset TEXT PRIMARY KEY, folder TEXT, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS passes (
  id INTEGER PRIMARY KEY AUTOINCREMENT, host TEXT NOT NULL, pid INTEGER NOT NULL,
  started REAL NOT NULL, heartbeat REAL NOT NULL);
"""


def _process_alive(pid: int) -> bool | None:
    """Whether a local process exists; None when it cannot be told (then the heartbeat decides)."""
    try:
        import psutil
        return psutil.pid_exists(pid)
    except ImportError:
        pass
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _open_database(path: Path) -> sqlite3.Connection:
    """The cache's database in WAL mode with its tables, opened safely beside other processes opening it too.

    SQLite's busy timeout makes a connection wait out another's lock, but not everywhere: switching a file to WAL
    needs it exclusively, and a connection that meets another's lock there is told "database is locked" at once
    (SQLite does not wait where waiting could deadlock). Two servers, or a server and a tool, opening one new
    cache folder together then lost one of them its caching pass. So the set-up is retried here, within the same
    budget. WAL is a property of the file: once any process has switched it, the switch takes no lock."""
    db = sqlite3.connect(path, timeout=DB_BUSY_S, isolation_level=None, check_same_thread=False)
    deadline, pause = time.monotonic() + DB_BUSY_S, 0.01
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(f"BEGIN IMMEDIATE;{SCHEMA}COMMIT;")
            return db
        except sqlite3.Error as exc:
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            locked = isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))
            if not locked or time.monotonic() > deadline:  # a damaged, read-only or full cache: its own error
                db.close()
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.5)


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
        self.shards = self.root / SHARDS_DIR
        self._db = _open_database(self.root / DB_FILE)
        self._pass_id: int | None = None
        self._last_beat = 0.0

    def close(self):
        if self._pass_id is not None:
            self._end_pass()
        self._db.close()

    @contextlib.contextmanager
    def _write(self):
        """One write transaction: SQLite's write lock is the mutex between writers and prune, across processes."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _shard(self, kind, key) -> Path | None:
        """The shard path of a row, or None when the row is not one this pack wrote or escapes the shards folder."""
        if not valid_entry_id(kind, key):
            return None
        path = entry_path(self.root, kind, key)
        if path.is_symlink() or (path.parent.exists() and not resolves_inside(path.parent, self.shards)):
            return None
        return path

    def _drop_hostile(self, key, kind) -> None:
        """Removes a row this pack cannot have written; never touches a file."""
        self._db.execute("DELETE FROM entries WHERE key IS ? AND kind IS ?", (key, kind))

    # caching passes: what a pass in progress looks up or writes is kept by prune ------------
    @contextlib.contextmanager
    def caching_pass(self):
        """Registers a caching pass for the duration of the block: prune keeps every entry created or used
        since the oldest live pass began, so a pass's entries survive until it records its dataset."""
        if self._pass_id is not None:  # nested: the outer pass already protects us
            yield self
            return
        now = time.time()
        with self._write() as db:
            self._pass_id = db.execute("INSERT INTO passes (host, pid, started, heartbeat) VALUES (?, ?, ?, ?)",
                                       (socket.gethostname(), os.getpid(), now, now)).lastrowid
        self._last_beat = now
        try:
            yield self
        finally:
            self._end_pass()

    def _end_pass(self):
        pass_id, self._pass_id = self._pass_id, None
        try:
            self._db.execute("DELETE FROM passes WHERE id=?", (pass_id,))
        except sqlite3.Error:
            pass  # a pass row left behind goes stale on its own

    def _beat(self):
        now = time.time()
        if self._pass_id is not None and now - self._last_beat >= PASS_HEARTBEAT_S:
            self._db.execute("UPDATE passes SET heartbeat=? WHERE id=?", (now, self._pass_id))
            self._last_beat = now

    def _oldest_live_pass(self, db) -> float | None:
        """Start time of the oldest live caching pass; dead passes' rows are removed on the way."""
        now, host, oldest = time.time(), socket.gethostname(), None
        for pass_id, pass_host, pid, started, heartbeat in db.execute(
                "SELECT id, host, pid, started, heartbeat FROM passes").fetchall():
            dead = not isinstance(heartbeat, (int, float)) or now - heartbeat > PASS_STALE_S
            if not dead and pass_host == host and isinstance(pid, int):
                dead = _process_alive(pid) is False
            if dead:
                db.execute("DELETE FROM passes WHERE id=?", (pass_id,))
            elif isinstance(started, (int, float)):
                oldest = started if oldest is None else min(oldest, started)
        return oldest

    # entries -------------------------------------------------------------------------------
    def lookup(self, key: str, verify: bool = True) -> Entry | None:
        """The entry if present and intact; a damaged or missing shard drops the entry (returns None)."""
        row = self._db.execute("SELECT kind, checksum FROM entries WHERE key=?", (key,)).fetchone()
        if row is None:
            return None
        kind, checksum = row
        path = self._shard(kind, key)
        if path is None:
            self._drop_hostile(key, kind)
            return None
        self._beat()
        # marked used before it is checked: a prune that runs after this sees it used by the live pass and
        # keeps it; one that ran before removed the row, so the update finds nothing
        if self._db.execute("UPDATE entries SET used=? WHERE key=? AND checksum=?",
                            (time.time(), key, checksum)).rowcount == 0:
            return None
        try:
            intact = path.is_file() and (not verify or file_sha256(path) == checksum)
        except OSError:
            intact = False
        if not intact:
            self._db.execute("DELETE FROM entries WHERE key=? AND checksum=?", (key, checksum))
            return None
        return Entry(key, kind, path, checksum)

    def _intact_row(self, db, key: str) -> Entry | None:
        row = db.execute("SELECT kind, checksum FROM entries WHERE key=?", (key,)).fetchone()
        if row is None:
            return None
        path = self._shard(row[0], key)
        if path is None:
            self._drop_hostile(key, row[0])
            return None
        try:
            if path.is_file() and file_sha256(path) == row[1]:
                return Entry(key, row[0], path, row[1])
        except OSError:
            pass
        return None

    def put(self, kind: str, key: str, tensors: dict, meta: dict | None = None) -> Entry:
        """Stores an entry; if another writer stored this key first and its shard is intact, that entry wins."""
        from safetensors.torch import save_file
        path = entry_path(self.root, kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not resolves_inside(path.parent, self.shards):
            raise ValueError(f"cache shard folder {path.parent} resolves outside {self.shards}")
        with atomic_write(path, prefix=f".{key[:12]}-") as staged:  # the name prune knows (_TEMP_NAME)
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, staged.path,
                      metadata={k: str(v) for k, v in (meta or {}).items()})
            checksum = file_sha256(staged.path)
            size = os.path.getsize(staged.path)
            with self._write() as db:
                existing = self._intact_row(db, key)
                if existing is not None:
                    staged.discard()
                    db.execute("UPDATE entries SET used=? WHERE key=?", (time.time(), key))
                    return existing
                staged.commit()  # under the write lock: prune never sees the shard without its row
                now = time.time()
                db.execute("INSERT OR REPLACE INTO entries (key, kind, checksum, bytes, meta, created, used) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?)", (key, kind, checksum, size, json.dumps(meta or {}), now, now))
                if self._pass_id is not None:
                    db.execute("UPDATE passes SET heartbeat=? WHERE id=?", (now, self._pass_id))
                    self._last_beat = now
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
    def set_dataset(self, dataset: str, folder: str, keys, replaces=()) -> None:
        """Records the entries a dataset uses (replacing its previous record, and those named in `replaces`)."""
        keys = sorted(set(keys))
        with self._write() as db:
            for name in (dataset, *replaces):
                db.execute("DELETE FROM dataset_entries WHERE dataset=?", (name,))
                db.execute("DELETE FROM datasets WHERE dataset=?", (name,))
            db.executemany("INSERT OR IGNORE INTO dataset_entries (dataset, key) VALUES (?, ?)",
                           [(dataset, k) for k in keys])
            db.execute("INSERT OR REPLACE INTO datasets (dataset, folder, updated) VALUES (?, ?, ?)",
                       (dataset, folder, time.time()))

    def pin_manifest(self, manifest: str | Path, keys) -> None:
        """Keeps these entries while the manifest file exists (a run, live or resumable, reads them)."""
        manifest = os.path.realpath(manifest)
        self.set_dataset(RUN_PIN_PREFIX + manifest, manifest, keys)

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
        """Removes entries nothing uses, shards without a row and leftovers of interrupted writes.

        In use: entries of a recorded dataset, of a run manifest that still exists, and every entry created
        or used since the oldest live caching pass began. Runs as one write transaction, so no writer can
        rename a shard or insert a row while it decides and deletes. Files are only ever removed at paths
        built from a valid kind and key (or a temporary name) inside the shards folder."""
        removed, freed, dropped = 0, 0, 0
        with self._write() as db:
            for name, manifest, updated in db.execute(
                    "SELECT dataset, folder, updated FROM datasets WHERE dataset LIKE ?",
                    (RUN_PIN_PREFIX + "%",)).fetchall():
                # a pin is recorded just before its manifest is written: young pins stay even without the file
                young = isinstance(updated, (int, float)) and time.time() - updated < ORPHAN_GRACE_S
                if not young and not (isinstance(manifest, str) and os.path.isfile(manifest)):
                    db.execute("DELETE FROM dataset_entries WHERE dataset=?", (name,))
                    db.execute("DELETE FROM datasets WHERE dataset=?", (name,))
            for key, kind in db.execute("SELECT key, kind FROM entries").fetchall():
                if self._shard(kind, key) is None:
                    self._drop_hostile(key, kind)
                    dropped += 1
            since = self._oldest_live_pass(db)
            unused = ("SELECT key, kind, bytes FROM entries WHERE key NOT IN (SELECT key FROM dataset_entries)"
                      + ("" if since is None else " AND created < ? AND used < ?"))
            for key, kind, size in db.execute(unused, () if since is None else (since, since)).fetchall():
                db.execute("DELETE FROM entries WHERE key=?", (key,))
                path = self._shard(kind, key)
                if path is not None:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed, freed = removed + 1, freed + (size if isinstance(size, int) else 0)
            known = {k for (k,) in db.execute("SELECT key FROM entries")}
            n, size = self._sweep_files(known, older_than_s)
            removed, freed = removed + n, freed + size
        return {"removed": removed, "freed_bytes": freed, "dropped_invalid_rows": dropped}

    def _sweep_files(self, known: set, temp_older_than_s: float) -> tuple[int, int]:
        """Unlinks shards without a row and stale temporary files, touching only names this pack makes,
        in real (not symlinked) folders of the layout kind/xx/ inside the shards folder."""
        removed, freed, now = 0, 0, time.time()
        if not self.shards.is_dir() or self.shards.is_symlink():
            return 0, 0
        for kind in KINDS:
            kind_dir = self.shards / kind
            if kind_dir.is_symlink() or not kind_dir.is_dir():
                continue
            for sub in os.scandir(kind_dir):
                if not (len(sub.name) == 2 and sub.is_dir(follow_symlinks=False)
                        and all(c in "0123456789abcdef" for c in sub.name)):
                    continue
                for f in os.scandir(sub.path):
                    try:  # a writer beside this writes and removes its temporary files outside the lock
                        stat = f.stat(follow_symlinks=False) if f.is_file(follow_symlinks=False) else None
                    except FileNotFoundError:
                        continue
                    if stat is None:
                        continue
                    age = now - stat.st_mtime
                    if f.name.endswith(SHARD_SUFFIX):
                        key = f.name[:-len(SHARD_SUFFIX)]
                        doomed = (ENTRY_KEY.fullmatch(key) is not None and key[:2] == sub.name and key not in known
                                  and age > ORPHAN_GRACE_S)
                    else:
                        doomed = _TEMP_NAME.fullmatch(f.name) is not None and age > temp_older_than_s
                    if doomed and resolves_inside(Path(f.path), self.shards):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(f.path)
                            removed, freed = removed + 1, freed + stat.st_size
        return removed, freed


def write_manifest(path: str | Path, dataset, cache_root: str | Path) -> Path:
    """The trainer's view of a cached dataset: per item its shards (key + checksum) and bucket. Its entries are
    pinned in the cache (under the manifest's path) before it is written, so prune keeps them while this file
    exists: for the run that reads it, and for any later resume of that run."""
    path = Path(path)
    store = CacheStore(cache_root)
    try:
        store.pin_manifest(path, dataset.cache_keys())
    finally:
        store.close()
    manifest = {
        "version": MANIFEST_VERSION,
        "cache_root": str(cache_root),
        "folder": dataset.folder, "repeats": dataset.repeats,
        "fps": float(getattr(dataset, "fps", 0.0)), "audio": bool(getattr(dataset, "audio", False)),  # of the clips
        "text_extras_kept": bool(getattr(dataset, "keeps_text_extras", False)),  # beside the captions' embeddings
        "fields": ["source", "caption", "latent", "latent_sha256", "text", "text_sha256", "width", "height", "flip",
                   "text_variants", "masked", "frames", "references"],
        # frames: a clip item's frame count (0: a still image); references: reference slots in its latent shard
        "items": [[i.path, i.caption, i.latent, i.latent_sha, i.text, i.text_sha, i.bucket[0], i.bucket[1], i.flip,
                   [list(v) for v in i.text_variants], bool(i.mask_source), i.frames, len(i.references)]
                  for i in dataset.items],
        # the empty caption's embedding (caption dropout), [key, sha256], or null where it was not cached
        "empty_text": list(dataset.empty_text) if dataset.empty_text else None,
    }
    return atomic_write_text(path, json.dumps(manifest, separators=(",", ":")))
