"""Unit tests (no server, no trainer launch) of the trainer's shape: the atomic writer, the layout interface,
the choices table, the host-sync cadence."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

import conftest  # noqa: F401  (registers the pack as the ingraph_trainer package)


def test_atomic_write_leaves_the_old_file_on_failure_and_no_temporary(tmp_path):
    from ingraph_trainer.cache.files import atomic_write, atomic_write_text
    target = tmp_path / "manifest.json"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_write(target) as staged:
            staged.path.write_text("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert oct(target.stat().st_mode & 0o777) == "0o644"


def test_concurrent_writers_of_one_file_never_share_a_temporary(tmp_path):
    """The manifest writer used a fixed `<name>.tmp`: two writers could rename each other's half-written file."""
    from ingraph_trainer.cache.files import atomic_write
    target = tmp_path / "dataset.json"
    inside = threading.Barrier(2)
    temporaries = []

    def write(text):
        with atomic_write(target) as staged:
            temporaries.append(staged.path)
            staged.path.write_text(text)
            inside.wait(5)  # both are between writing and renaming
    threads = [threading.Thread(target=write, args=(text * 1000,)) for text in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(temporaries)) == 2
    assert target.read_text() in ("a" * 1000, "b" * 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset.json"]


def test_discarded_staging_leaves_the_target_alone(tmp_path):
    from ingraph_trainer.cache.files import atomic_write
    target = tmp_path / "shard.safetensors"
    with atomic_write(target, prefix=".0123456789ab-") as staged:
        assert staged.path.name.startswith(".0123456789ab-") and staged.path.name.endswith(".partial")
        staged.path.write_bytes(b"x")
        staged.discard()
    assert list(tmp_path.iterdir()) == []


def test_manifest_writes_go_through_the_atomic_writer(tmp_path, monkeypatch):
    from ingraph_trainer.cache import store
    written = []
    monkeypatch.setattr(store, "atomic_write_text", lambda path, text: written.append(Path(path)) or Path(path))

    class Dataset:
        folder, repeats, items = "f", 1, []
    monkeypatch.setattr(store.CacheStore, "pin_manifest", lambda self, path, keys: None)
    store.write_manifest(tmp_path / "dataset.json", Dataset(), tmp_path / "cache")
    assert written == [tmp_path / "dataset.json"]
