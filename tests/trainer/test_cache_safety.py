"""Cache safety (prune beside writers, hostile rows, shared folders, encoders) and image decoding.

Unit tier except the last test: the pack's own caching code (encode_latents / encode_text / record_usage)
runs with small stand-in encoders, so no model weights are needed.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from conftest import REPO  # noqa: E402  (conftest registers the pack as the package ingraph_trainer)

shards_mod = importlib.import_module("ingraph_trainer.cache.shards")
store_mod = importlib.import_module("ingraph_trainer.cache.store")
captions_mod = importlib.import_module("ingraph_trainer.cache.captions")
folder_scan_mod = importlib.import_module("ingraph_trainer.cache.folder_scan")
pixels_mod = importlib.import_module("ingraph_trainer.cache.pixels")
encoding = importlib.import_module("ingraph_trainer.cache.encoding")
CacheStore, DatasetError = store_mod.CacheStore, pixels_mod.DatasetError

# Stand-in encoders with the interface encoding.py uses; the writer process below defines the same.
FAKE_ENCODERS = '''
import torch

class FakeVAE:
    def __init__(self, seed):
        self.seed = seed
    def get_sd(self):
        return {"w": torch.full((4,), float(self.seed))}
    def encode(self, pixels):
        b, h, w, _ = pixels.shape
        return pixels.permute(0, 3, 1, 2)[:, :, ::8, ::8].mean(1, keepdim=True).repeat(1, 4, 1, 1) + self.seed

class FakeCLIP:
    def __init__(self, seed):
        self.seed = seed
    def get_sd(self):
        return {"w": torch.full((4,), float(self.seed))}
    def tokenize(self, text):
        return text
    def encode_from_tokens(self, tokens, return_pooled=True, return_dict=True):
        v = float(sum(map(ord, tokens)) % 97 + self.seed)
        return {"cond": torch.full((1, 4, 8), v), "pooled_output": torch.full((1, 8), v)}
'''
fakes = types.ModuleType("fake_encoders")
exec(FAKE_ENCODERS, fakes.__dict__)


def make_images(folder: Path, count: int, size: int = 64, seed: int = 0) -> Path:
    sys.path.insert(0, str(REPO))
    from tools.embedded_default import build_images
    build_images(folder, count=count, size=size, seed=seed)
    return folder


def intact_rows(root: Path) -> dict[str, str]:
    """key -> kind of every row, asserting that each has a shard whose sha256 matches its checksum."""
    db = sqlite3.connect(root / "cache.sqlite")
    rows = db.execute("SELECT key, kind, checksum FROM entries").fetchall()
    db.close()
    for key, kind, checksum in rows:
        shard = root / "shards" / kind / key[:2] / f"{key}.safetensors"
        assert shard.is_file(), f"row {key} has no shard"
        assert hashlib.sha256(shard.read_bytes()).hexdigest() == checksum, f"shard {shard} is damaged"
    return {key: kind for key, _, _ in rows}


# --- prune beside a caching pass --------------------------------------------------------------------------------

WRITER = textwrap.dedent('''
    import json, sys, types
    repo, images, root = sys.argv[1:4]
    sys.path.insert(0, repo)
    pkg = types.ModuleType("ingraph_trainer"); pkg.__path__ = [repo]; sys.modules["ingraph_trainer"] = pkg
    from ingraph_trainer.cache.folder_scan import scan_image_folder
    from ingraph_trainer.cache.encoding import encode_latents, encode_text, record_usage
    from ingraph_trainer.cache.store import CacheStore
    ''') + FAKE_ENCODERS + textwrap.dedent('''
    store = CacheStore(root)
    print("started", flush=True)
    with store.caching_pass():
        dataset = scan_image_folder(images, resolution=64)
        dataset, encoded, reused = encode_latents(dataset, FakeVAE(1), store)
        dataset, _, _ = encode_text(dataset, FakeCLIP(1), store)
        record_usage(dataset, store)
    store.close()
    print(json.dumps({"encoded": encoded, "keys": sorted({k for i in dataset.items for k in (i.latent, i.text)})}))
    ''')


def exited(process, pause_s: float = 0.01) -> bool:
    """Waits briefly for the process: between prunes the writer gets a chance at SQLite's write lock (its busy
    handler backs off, so a loop that re-takes the lock at once would starve it)."""
    try:
        process.wait(pause_s)
        return True
    except subprocess.TimeoutExpired:
        return False


# Six processes open one new cache folder at the same instant, fifty times over (a few seconds): the switch to
# WAL met another opener's lock about once in ten folders and failed at once, whatever the busy timeout.
OPENERS = """
import multiprocessing, sys, tempfile, time, types
pkg = types.ModuleType("ingraph_trainer"); pkg.__path__ = [sys.argv[1]]; sys.modules["ingraph_trainer"] = pkg
from ingraph_trainer.cache.store import CacheStore

def open_and_pass(root, together, results):
    waits = []
    sleep, time.sleep = time.sleep, lambda s: (waits.append(s), sleep(s))  # retries made while opening
    together.wait()
    try:
        store = CacheStore(root)
        with store.caching_pass():
            pass
        store.close()
        results.put(("ok", len(waits)))
    except Exception as exc:
        results.put((f"{type(exc).__name__}: {exc}", len(waits)))

fork = multiprocessing.get_context("fork")
outcomes = []
for _ in range(int(sys.argv[2])):
    root, together, results = tempfile.mkdtemp(dir=sys.argv[3]), fork.Barrier(6, timeout=60), fork.Queue()
    openers = [fork.Process(target=open_and_pass, args=(root, together, results), daemon=True) for _ in range(6)]
    for p in openers: p.start()
    outcomes += [results.get(timeout=120) for _ in openers]
    for p in openers: p.join()
print(repr(outcomes))
"""


def test_processes_opening_one_new_cache_together_all_get_it(tmp_path):
    """Two servers (or a server and a tool) caching into one new folder at once: each opens the database."""
    out = subprocess.run([sys.executable, "-c", OPENERS, str(REPO), "50", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    outcomes = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert len(outcomes) == 300
    failed = [message for message, _ in outcomes if message != "ok"]
    assert not failed, f"{len(failed)} of 300 opens failed: {sorted(set(failed))}"
    print(f"\nopens that waited out another's switch to WAL: {sum(1 for _, waits in outcomes if waits)} of 300")


def test_opening_a_cache_waits_out_a_writer_holding_it(tmp_path):
    """The race above, made certain: another process is mid-write (holding the write lock) when the cache, not
    yet in WAL mode, is opened; the open waits for it rather than failing at once."""
    import threading
    writer = sqlite3.connect(tmp_path / store_mod.DB_FILE, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE other (x)")
    writer.execute("BEGIN IMMEDIATE")
    opened = []
    opener = threading.Thread(target=lambda: opened.append(CacheStore(tmp_path)))
    opener.start()
    opener.join(0.5)
    assert opener.is_alive() and not opened  # it waits while the write lock is held
    writer.execute("COMMIT")
    opener.join(30)
    assert opened, "the cache did not open once the writer let go"
    assert opened[0]._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    opened[0].close()
    writer.close()


def test_prune_in_a_loop_beside_a_caching_pass_loses_nothing(tmp_path):
    images = make_images(tmp_path / "images", 200)
    root = tmp_path / "cache"
    pruner = CacheStore(root)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(REPO), str(images), str(root)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "started"
    prunes = 0
    while not exited(writer):
        pruner.prune()
        prunes += 1
    out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["encoded"] == 200
    rows = intact_rows(root)
    missing = [k for k in result["keys"] if k not in rows]
    assert not missing, f"{len(missing)} of {len(result['keys'])} keys the dataset uses lost their row or shard"
    assert pruner.prune()["removed"] == 0  # everything left is in use
    assert len(intact_rows(root)) == 200 + 8 + 1  # latents, captions, the empty caption
    pruner.close()
    print(f"prune ran {prunes} times beside the writer; {len(rows)} rows checked intact")
    assert prunes >= 2


def test_a_dead_pass_protects_nothing_and_a_live_one_protects_its_entries(tmp_path):
    root = tmp_path / "cache"
    writer, pruner = CacheStore(root), CacheStore(root)
    import torch
    key = shards_mod.content_key(n=1)
    with writer.caching_pass():
        writer.put("latent", key, {"x": torch.zeros(2)})
        assert pruner.prune()["removed"] == 0 and pruner.lookup(key) is not None
    # a pass row of a process that no longer exists (crashed without cleaning up)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    db = sqlite3.connect(root / "cache.sqlite")
    import socket
    db.execute("INSERT INTO passes (host, pid, started, heartbeat) VALUES (?, ?, 0, strftime('%s','now'))",
               (socket.gethostname(), int(dead.stdout)))
    db.commit()
    db.close()
    assert pruner.prune()["removed"] == 1 and pruner.lookup(key) is None


def test_a_run_manifest_pins_its_entries_while_it_exists(tmp_path, monkeypatch):
    images = make_images(tmp_path / "images", 4)
    root = tmp_path / "cache"
    store = CacheStore(root)
    dataset = folder_scan_mod.scan_image_folder(images, resolution=64)
    dataset, _, _ = encoding.encode_latents(dataset, fakes.FakeVAE(1), store)
    dataset, _, _ = encoding.encode_text(dataset, fakes.FakeCLIP(1), store)  # never recorded as a dataset
    (tmp_path / "run").mkdir()
    manifest = store_mod.write_manifest(tmp_path / "run" / "dataset.json", dataset, root)
    assert store.prune()["removed"] == 0 and len(intact_rows(root)) == 4 + 4 + 1  # and the empty caption
    manifest.unlink()  # the run folder was deleted
    assert store.prune()["removed"] == 0, "a fresh pin may precede its manifest file"
    monkeypatch.setattr(store_mod, "ORPHAN_GRACE_S", 0.0)
    assert store.prune()["removed"] == 4 + 4 + 1 and intact_rows(root) == {}
    store.close()


# --- hostile rows -----------------------------------------------------------------------------------------------

def test_hostile_rows_delete_and_read_nothing(tmp_path):
    root = tmp_path / "cache"
    store = CacheStore(root)
    outside = tmp_path / "outside"
    keys = iter(f"{n:02x}" * 32 for n in range(0xa0, 0xff))  # distinct well-formed keys
    planted, hostile = [], []

    def plant(path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("precious")
        planted.append(path)

    def row(kind, key=None):
        key = key or next(keys)
        hostile.append((kind, key))
        return key

    # traversal in the key (the layout appends .safetensors)
    plant(outside / "victim.safetensors")
    row("latent", "../../../outside/victim")
    # traversal in the kind: shards/../../outside/<xx>/<key>.safetensors
    key = row("../../outside")
    plant(outside / key[:2] / f"{key}.safetensors")
    # absolute key and absolute kind
    plant(outside / "absolute.safetensors")
    row("latent", str(outside / "absolute"))
    key = row(str(outside / "abskind"))
    plant(outside / "abskind" / key[:2] / f"{key}.safetensors")
    # a kind this pack never writes, inside the shards folder
    key = row("foo")
    plant(root / "shards" / "foo" / key[:2] / f"{key}.safetensors")
    # a well-formed row whose kind folder is a symlink out of the shards folder
    key = row("text")
    plant(outside / "textdir" / key[:2] / f"{key}.safetensors")
    (root / "shards" / "text").symlink_to(outside / "textdir", target_is_directory=True)
    # a kind that is not even a string; an upper-case key (not what content_key makes)
    row(7)
    key = row("latent", "AB" * 32)
    plant(root / "shards" / "latent" / "AB" / f"{key}.safetensors")
    # files an orphan sweep must never consider: beside the database, in a folder not the key's prefix
    plant(root / "notes.safetensors")
    plant(root / "shards" / "latent" / "zz" / f"{'cd' * 32}.safetensors")

    db = sqlite3.connect(root / "cache.sqlite")
    db.executemany("INSERT INTO entries (key, kind, checksum, bytes, meta, created, used) "
                   "VALUES (?, ?, ?, 8, '{}', 0, 0)",
                   [(key, kind, hashlib.sha256(b"precious").hexdigest()) for kind, key in hostile])
    db.commit()
    db.close()
    for path in planted:
        os.utime(path, (1_000_000_000, 1_000_000_000))  # older than every grace period

    for kind, key in hostile:
        assert store.lookup(key) is None
        with pytest.raises(ValueError, match="invalid cache entry"):
            shards_mod.load_checked(root, kind, key, "0" * 64)
    db = sqlite3.connect(root / "cache.sqlite")  # the rows lookup met are gone; plant them again for prune
    db.executemany("INSERT OR IGNORE INTO entries (key, kind, checksum, bytes, meta, created, used) "
                   "VALUES (?, ?, ?, 8, '{}', 0, 0)",
                   [(key, kind, hashlib.sha256(b"precious").hexdigest()) for kind, key in hostile])
    db.commit()
    db.close()
    result = store.prune(older_than_s=0)
    for path in planted:
        assert path.read_text() == "precious", f"{path} was touched"
    assert store.stats()["entries"] == 0, "hostile rows are dropped"
    assert result["removed"] == 0 and result["dropped_invalid_rows"] == len(hostile)
    store.close()


# --- two servers sharing one folder ---------------------------------------------------------------------------

def test_first_writer_of_a_key_wins(tmp_path):
    import torch
    from safetensors.torch import load_file
    root = tmp_path / "cache"
    server_a, server_b = CacheStore(root), CacheStore(root)
    key = shards_mod.content_key(item=1)
    first = server_a.put("latent", key, {"x": torch.zeros(4)})
    second = server_b.put("latent", key, {"x": torch.ones(4)})  # same key, a slightly different encode
    assert second.checksum == first.checksum
    assert torch.equal(load_file(first.path)["x"], torch.zeros(4))
    assert server_b.lookup(key).checksum == first.checksum
    assert not list(first.path.parent.glob(".*")), "the loser's temporary file is left behind"
    assert intact_rows(root) == {key: "latent"}

    first.path.write_bytes(b"damaged")  # a row no longer vouching for its shard is replaced
    third = server_b.put("latent", key, {"x": torch.ones(4)})
    assert third.checksum != first.checksum and torch.equal(load_file(third.path)["x"], torch.ones(4))
    assert intact_rows(root) == {key: "latent"}
    server_a.close()
    server_b.close()


# --- encoders in a dataset's identity ------------------------------------------------------------------------------

def test_two_models_caching_one_folder_keep_separate_datasets(tmp_path):
    from PIL import Image
    images = make_images(tmp_path / "images", 4)
    root = tmp_path / "cache"
    store = CacheStore(root)

    def cache_for(model: int):
        dataset = folder_scan_mod.scan_image_folder(images, resolution=64)
        dataset, _, _ = encoding.encode_latents(dataset, fakes.FakeVAE(model), store)
        dataset, _, _ = encoding.encode_text(dataset, fakes.FakeCLIP(model), store)
        encoding.record_usage(dataset, store)
        return dataset

    sdxl, flux = cache_for(1), cache_for(2)
    assert len(store.stats()["datasets"]) == 4  # (latents, captions) x (SDXL-like, Flux-like)
    assert store.prune()["removed"] == 0 and len(intact_rows(root)) == 2 * (4 + 4 + 1)  # with each encoder's empty caption

    victim = sorted(images.glob("*.png"))[0]
    Image.open(victim).convert("RGB").rotate(90).save(victim)
    cache_for(1)  # only the SDXL-like latent of the edited image falls out of use
    assert store.prune()["removed"] == 1
    rows = intact_rows(root)
    assert all(i.latent in rows and i.text in rows for i in flux.items)
    assert sdxl.items[0].latent not in rows
    store.close()


# --- images and captions ------------------------------------------------------------------------------------------

def test_16_bit_png_is_scaled_not_clipped(tmp_path):
    import numpy as np
    from PIL import Image
    gradient = np.tile(np.linspace(0, 65535, 64).round().astype(np.uint16), (64, 1))
    path = tmp_path / "deep.png"
    Image.fromarray(gradient).save(path)
    with Image.open(path) as img:
        assert img.mode in pixels_mod.SIXTEEN_BIT_MODES
    (tmp_path / "deep.txt").write_text("a gradient")
    ds = folder_scan_mod.scan_image_folder(tmp_path, resolution=64)
    pixels = pixels_mod.load_image_tensor(str(path), ds.items[0].bucket)  # what encode_latents decodes
    assert abs(pixels.mean().item() - 0.5) < 0.5 * 0.02
    assert abs(pixels[0, 0, 0, 0].item()) < 0.01 and abs(pixels[0, 0, -1, 0].item() - 1.0) < 0.01
    assert ds.items[0].pixels == "16bit"


def _rgb_at(path, background=pixels_mod.DEFAULT_BACKGROUND):
    t = pixels_mod.load_image_tensor(str(path), 64, background=background)
    return tuple(round(v * 255) for v in t[0, 10, 10].tolist())


def test_transparent_images_are_composited_on_the_chosen_background(tmp_path):
    from PIL import Image
    rgba = tmp_path / "rgba.png"
    Image.new("RGBA", (64, 64), (255, 0, 0, 0)).save(rgba)  # invisible red
    half = tmp_path / "half.png"
    Image.new("RGBA", (64, 64), (255, 0, 0, 128)).save(half)
    grey_alpha = tmp_path / "la.png"
    Image.new("LA", (64, 64), (0, 0)).save(grey_alpha)
    palette = tmp_path / "palette.png"
    p = Image.new("P", (64, 64), 0)
    p.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    p.save(palette, transparency=0)  # index 0 (black) is transparent
    with Image.open(palette) as img:
        assert img.mode == "P" and "transparency" in img.info

    assert _rgb_at(rgba) == (255, 255, 255)
    assert _rgb_at(half)[0] == 255 and abs(_rgb_at(half)[1] - 127) <= 2
    assert _rgb_at(grey_alpha) == (255, 255, 255)
    assert _rgb_at(palette) == (255, 255, 255)
    blue = pixels_mod.parse_background("#0000ff")
    for path in (rgba, grey_alpha, palette):
        assert _rgb_at(path, blue) == (0, 0, 255), path.name
    with pytest.raises(DatasetError, match="transparent_background: 'bluish'"):
        pixels_mod.parse_background("bluish")

    # the background is part of a transparent image's latent key, and only of such images' keys
    Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "opaque.png")
    for f in tmp_path.glob("*.png"):
        f.with_suffix(".txt").write_text("x")

    def keys(background):
        ds = folder_scan_mod.scan_image_folder(tmp_path, resolution=64, background=background)
        return {Path(i.path).name: encoding.latent_key("d", i, ds, "vae") for i in ds.items}
    white, other = keys("#ffffff"), keys("#0000ff")
    assert white["opaque.png"] == other["opaque.png"]
    assert all(white[n] != other[n] for n in ("rgba.png", "la.png", "palette.png", "half.png"))


def test_exif_orientation_is_applied(tmp_path):
    from PIL import Image
    img = Image.new("RGB", (64, 32), (255, 0, 0))
    img.paste((0, 0, 255), (32, 0, 64, 32))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90 degrees clockwise
    path = tmp_path / "rotated.jpg"
    img.save(path, exif=exif, quality=95)
    (tmp_path / "rotated.txt").write_text("x")
    ds = folder_scan_mod.scan_image_folder(tmp_path, resolution=64, buckets=None)
    t = pixels_mod.load_image_tensor(str(path), (32, 64))
    assert tuple(t.shape) == (1, 64, 32, 3)
    top, bottom = t[0, 8, 16], t[0, 56, 16]
    assert top[0] > 0.8 and top[2] < 0.2, "the left (red) side should be on top"
    assert bottom[2] > 0.8 and bottom[0] < 0.2
    assert ds.items


def test_caption_bom_is_stripped(tmp_path):
    from PIL import Image
    Image.new("RGB", (64, 64)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes("\ufeffa cat".encode("utf-8"))
    assert folder_scan_mod.scan_image_folder(tmp_path, resolution=64).items[0].caption == "a cat"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="skipped: no named pipes on this system")
def test_a_caption_that_is_a_pipe_or_too_large_is_an_error_not_a_hang(tmp_path):
    """Any client's graph can name a folder: a caption that is a named pipe would block ComfyUI's only executor (and
    /interrupt cannot end a blocked read); a huge one would be read and tokenised whole (issue 28, finding 10)."""
    import threading
    from PIL import Image
    Image.new("RGB", (64, 64)).save(tmp_path / "a.png")
    os.mkfifo(tmp_path / "a.txt")
    outcome = {}

    def scan():
        try:
            folder_scan_mod.scan_image_folder(tmp_path, resolution=64)
        except Exception as exc:  # noqa: BLE001  (the outcome is checked below)
            outcome["error"] = exc
    reader = threading.Thread(target=scan, daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # unblock the stuck open so the thread can end, then fail
        with open(tmp_path / "a.txt", "w"):
            pass
        pytest.fail("reading a named pipe as a caption blocked")
    assert isinstance(outcome.get("error"), pixels_mod.DatasetError)
    assert "cannot read caption file" in str(outcome["error"]) and "a.txt: not a regular file" in str(outcome["error"])
    os.unlink(tmp_path / "a.txt")
    (tmp_path / "a.txt").write_bytes(b"x" * (captions_mod.MAX_CAPTION_BYTES + 1))
    with pytest.raises(pixels_mod.DatasetError, match=rf"a.txt: {captions_mod.MAX_CAPTION_BYTES + 1} bytes; at most"):
        folder_scan_mod.scan_image_folder(tmp_path, resolution=64)


def test_symlink_loops_and_non_utf8_names_are_errors_naming_the_file(tmp_path):
    from PIL import Image
    Image.new("RGB", (64, 64)).save(tmp_path / "ok.png")
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "loop.png").symlink_to(tmp_path / "loop.png")
    with pytest.raises(DatasetError, match=r"loop\.png: a symlink loop"):
        folder_scan_mod.scan_image_folder(tmp_path, resolution=64)
    (tmp_path / "loop.png").unlink()

    (tmp_path / "ok.txt").unlink()
    (tmp_path / "ok.txt").symlink_to(tmp_path / "ok.txt")
    with pytest.raises(DatasetError, match=r"ok\.txt: a symlink loop"):
        folder_scan_mod.scan_image_folder(tmp_path, resolution=64)
    (tmp_path / "ok.txt").unlink()
    (tmp_path / "ok.txt").write_text("fine")

    bad = os.path.join(os.fsencode(tmp_path), b"caf\xe9.png")
    with open(bad, "wb") as f:
        f.write((tmp_path / "ok.png").read_bytes())
    with pytest.raises(DatasetError, match=r"caf\\xe9\.png is not valid UTF-8") as info:
        folder_scan_mod.scan_image_folder(tmp_path, resolution=64)
    str(info.value).encode("utf-8")  # the message itself travels as UTF-8 (no lone surrogates)


# --- the real encoders and a trainer run on a cache pruned while it was filled ---------------------------------------

REAL_PASS_IMAGES = 32  # enough for prune to run many times beside the real encoders


@pytest.mark.comfyui
def test_real_caching_pass_beside_prune_then_training_finishes(assets, tools, tmp_path):
    """tools/prepare_run.py caches in its own process (a child of the session's tool worker, its imports paid
    already, so the prunes run beside the encoding, not beside an import) while this process prunes."""
    import threading
    from conftest import run_trainer
    images = make_images(tmp_path / "images", REAL_PASS_IMAGES, seed=11)
    run_dir = tmp_path / "run"
    root = tmp_path / "cache"  # prepare_run.py caches into the run folder's sibling "cache"
    argv = ["--checkpoint", assets["checkpoint"], "--images", images, "--run-dir", run_dir, "--set", "train.steps=2",
            "--set", "train.precision=\"fp32\"", "--set", "train.eval_quantiles=[0.5]"]  # every item read, 1 pass each
    outcome: dict = {}

    def prepare_run():
        try:
            outcome["out"] = tools("prepare_run", argv)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            outcome["error"] = exc
    prepare = threading.Thread(target=prepare_run)
    prepare.start()
    pruner = CacheStore(root)
    prunes, removed, mid_fill = 0, 0, 0
    total = REAL_PASS_IMAGES + 8 + 1
    while prepare.is_alive():
        removed += pruner.prune()["removed"]
        prunes += 1
        mid_fill += 0 < pruner.stats()["entries"] < total  # a prune beside the encoding, not before or after it
        prepare.join(0.01)  # between prunes the writer gets a chance at SQLite's write lock (see `exited`)
    if "error" in outcome:
        raise outcome["error"]
    out = outcome["out"]
    rows = intact_rows(root)
    assert mid_fill > 0, "no prune ran while the cache was being filled"
    assert len(rows) == total and removed == 0  # the 8 captions and the empty one
    manifest = shards_mod.read_manifest(run_dir / "dataset.json")
    assert all(item[2] in rows and item[4] in rows for item in manifest["items"])
    print(f"prune ran {prunes} times, {mid_fill} of them on a part-filled cache; {len(rows)} rows checked intact")
    result = run_trainer(Path(out.strip().splitlines()[-1]), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    pruner.close()


def test_prune_never_unlinks_a_shard_a_writer_is_committing(tmp_path, monkeypatch):
    """No grace period and no caching pass: only the write lock stands between a writer's rename and its row."""
    import threading
    import time
    import torch
    monkeypatch.setattr(store_mod, "ORPHAN_GRACE_S", 0.0)
    root = tmp_path / "cache"
    writer, pruner = CacheStore(root), CacheStore(root)
    errors: list = []

    def write():
        try:
            for n in range(300):
                writer.put("latent", shards_mod.content_key(n=n), {"x": torch.full((64,), float(n))})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    prunes = 0
    while thread.is_alive():
        pruner.prune()  # no dataset uses these entries: prune removes rows and shards together
        prunes += 1
        time.sleep(0.005)  # SQLite's busy wait backs off: a prune that re-takes the lock at once starves writers
    thread.join()
    assert not errors and prunes >= 2
    intact_rows(root)  # every row left has its shard, with its checksum
    writer.close()
    pruner.close()


def test_an_edit_pairs_caption_is_encoded_with_its_source_image_by_qwen_images_text_encoder(tmp_path):
    """Qwen-Image-Edit (2509 and later) is conditioned at inference by TextEncodeQwenImageEditPlus: "Picture 1:"
    and the source image (scaled to about 384x384) read by Qwen2.5-VL beside the prompt, in its own template. An
    edit LoRA trained on the caption alone learns another conditioning. Under Qwen-Image's text encoder each pair's
    caption (and its tag-shuffled variants) is encoded so; another text encoder, or an item with no source, keeps
    the caption alone and the key it had."""
    import torch
    from PIL import Image
    from ingraph_trainer.cache.folder_scan import scan_image_folder
    from ingraph_trainer.cache.encoding import IMAGE_TOKENS, VISION_PIXELS, encode_text, text_key
    from ingraph_trainer.cache.store import CacheStore
    pairs, plain = tmp_path / "pairs", tmp_path / "plain"
    for name, source in (("a", (10, 200, 10)), ("b", (200, 200, 10)), ("c", None)):
        folder = pairs if source else plain
        folder.mkdir(exist_ok=True)
        Image.new("RGB", (64, 48), (200, 10, 10)).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text("make it red, bright, glossy")  # one caption: only the source differs
        if source:
            Image.new("RGB", (64, 48), source).save(folder / f"{name}.ref.png")

    class QwenImageTokenizer:  # what ComfyUI's (comfy/text_encoders/qwen_image.py) holds
        llama_template_images = f"<|im_start|>system\nEdit.<|im_end|>\n<|im_start|>user\n{IMAGE_TOKENS}{{}}<|im_end|>"

    class QwenCLIP(fakes.FakeCLIP):
        tokenizer = QwenImageTokenizer()
        seen: list = []

        def tokenize(self, text, **kwargs):
            images = kwargs.get("images", [])
            self.seen.append((text, kwargs.get("llama_template"), [tuple(i.shape) for i in images]))
            return text, [tuple(float(c) for c in i[0, 0, 0, :3]) for i in images]

        def encode_from_tokens(self, tokens, return_pooled=True, return_dict=True):
            text, colours = tokens
            out = super().encode_from_tokens(text, return_pooled, return_dict)
            return {k: v + 1000 * sum(map(sum, colours)) for k, v in out.items()}

    dataset = scan_image_folder(pairs, resolution=64, caption_variants=2)
    assert [len(i.references) for i in dataset.items] == [1, 1]
    store = CacheStore(tmp_path / "cache")
    cached, encoded, _ = encode_text(dataset, QwenCLIP(1), store)
    by_name = {Path(i.path).stem: i for i in cached.items}
    assert by_name["a"].text != by_name["b"].text  # one caption, two conditionings
    with_image = [seen for seen in QwenCLIP.seen if seen[2]]
    texts = {text for text, _, _ in with_image}
    assert len(texts) > 1 and len(with_image) == 2 * len(texts) == encoded  # each text of a and of b
    for text, template, [(batch, height, width, channels)] in with_image:  # the source on the item's square crop
        assert text.startswith(f"Picture 1: {IMAGE_TOKENS}") and template == \
            "<|im_start|>system\nEdit.<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
        assert (batch, channels) == (1, 3) and height == width and abs(height * width - VISION_PIXELS) < 2 * width
    from safetensors.torch import load_file
    embedding = load_file(str(store.lookup(by_name["a"].text).path))["cond"]
    alone = fakes.FakeCLIP(1).encode_from_tokens(f"Picture 1: {IMAGE_TOKENS}{by_name['a'].caption}")["cond"][0]
    torch.testing.assert_close(embedding, alone + 1000 * (10 + 200 + 10) / 255)  # a's source reached it
    no_source, _, _ = encode_text(scan_image_folder(plain, resolution=64), QwenCLIP(1), store)
    assert no_source.items[0].text == text_key("make it red, bright, glossy", cached.text_encoder)  # as before

    QwenCLIP.seen.clear()
    again, encoded, reused = encode_text(dataset, QwenCLIP(1), store)
    assert encoded == 0 and QwenCLIP.seen == [] and [i.text for i in again.items] == [i.text for i in cached.items]
    (pairs / "a.ref.png").unlink()  # another source image: a new conditioning for a alone
    Image.new("RGB", (64, 48), (0, 0, 255)).save(pairs / "a.ref.png")
    changed, encoded, _ = encode_text(scan_image_folder(pairs, resolution=64, caption_variants=2), QwenCLIP(1), store)
    assert changed.items[0].text != cached.items[0].text and changed.items[1].text == cached.items[1].text
    text_only, _, _ = encode_text(dataset, fakes.FakeCLIP(1), store)
    assert len({i.text for i in text_only.items}) == 1

    class HunyuanImageTokenizer(QwenImageTokenizer):  # derives Qwen-Image's template; its edit node differs
        pass

    class HunyuanImageCLIP(QwenCLIP):
        tokenizer = HunyuanImageTokenizer()
    QwenCLIP.seen.clear()
    other, _, _ = encode_text(dataset, HunyuanImageCLIP(1), store)
    assert len({i.text for i in other.items}) == 1 and not [seen for seen in QwenCLIP.seen if seen[2]]
