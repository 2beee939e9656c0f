"""The persistent, incremental cache: real encodes with the tiny checkpoint's VAE and CLIP."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, evaluate_on_one_image, load_workflow
from waiting import wait_until

pytestmark = pytest.mark.comfyui

CACHE_TOOL = [sys.executable, str(REPO / "tools" / "cache_dataset.py")]


@pytest.fixture
def cache(assets, tools):
    """`cache(images, root, *extra)`: tools/cache_dataset.py's counts, run in the session's tool worker (a fresh
    CacheStore each call, as a new process would open; only the ComfyUI import is shared)."""
    def run(images, root, *extra) -> dict:
        printed = tools("cache_dataset", ["--checkpoint", assets["checkpoint"], "--images", images, "--cache", root,
                                          *extra])
        return json.loads(printed.strip().splitlines()[-1])
    return run


def all_entries_valid(root: Path) -> int:
    """Every row points at an intact shard; returns the number of entries."""
    import hashlib
    db = sqlite3.connect(root / "cache.sqlite")
    rows = db.execute("SELECT key, kind, checksum FROM entries").fetchall()
    db.close()
    for key, kind, checksum in rows:
        shard = root / "shards" / kind / key[:2] / f"{key}.safetensors"
        assert shard.is_file(), shard
        assert hashlib.sha256(shard.read_bytes()).hexdigest() == checksum, shard
    return len(rows)


@pytest.fixture
def images(assets, tmp_path):
    folder = tmp_path / "images"
    shutil.copytree(assets["images"], folder)
    return folder


def test_incremental_cache_encodes_only_what_changed(cache, images, tools, tmp_path):
    from PIL import Image
    root = tmp_path / "cache"
    first = cache(images, root)
    assert first["latents"] == {"encoded": 8, "reused": 0} and first["text"]["encoded"] == 8

    second = cache(images, root)
    assert second["latents"] == {"encoded": 0, "reused": 8} and second["text"]["encoded"] == 0

    for f in images.iterdir():  # touch: new mtimes, same bytes
        os.utime(f, (time.time() + 5, time.time() + 5))
    assert cache(images, root)["latents"]["encoded"] == 0

    target = images / "item_003.png"
    img = Image.open(target).convert("RGB")
    img.putpixel((0, 0), (1, 2, 3))
    img.save(target)
    changed = cache(images, root)
    assert changed["latents"] == {"encoded": 1, "reused": 7} and changed["text"]["encoded"] == 0

    (images / "item_007.png").unlink()
    (images / "item_007.txt").unlink()
    removed = cache(images, root)
    assert removed["latents"] == {"encoded": 0, "reused": 7}

    other_vae = tmp_path / "other_vae.safetensors"
    tools("embedded_default", ["--vae", other_vae, "--seed", "7"])
    swapped = cache(images, root, "--vae", str(other_vae))
    assert swapped["latents"] == {"encoded": 7, "reused": 0}
    assert swapped["text"] == {"encoded": 0, "reused": 7}
    assert all_entries_valid(root) == 8 + 1 + 7 + 8 + 1  # old latents, the edited one, new-VAE latents, texts, ""


def test_damaged_shard_is_detected_and_re_encoded(cache, images, tmp_path):
    root = tmp_path / "cache"
    cache(images, root)
    shard = sorted((root / "shards" / "latent").rglob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # one flipped bit in the tensor data
    shard.write_bytes(bytes(data))
    again = cache(images, root)
    assert again["latents"] == {"encoded": 1, "reused": 7}
    all_entries_valid(root)


def test_two_processes_filling_one_cache_leave_it_valid(cache, assets, tools, tmp_path):
    """Two processes caching the same folder at once (two children of the tool worker, each its own process with
    its own CacheStore, started together, no import between them: their encodes overlap at 64 px as they did at
    128)."""
    from tools.embedded_default import build_images
    images = tmp_path / "many"
    build_images(images, count=40, size=64, seed=3)
    root = tmp_path / "cache"
    args = ["--checkpoint", str(assets["checkpoint"]), "--images", str(images), "--cache", str(root), "--resolution", "64"]
    results = [json.loads(out.strip().splitlines()[-1]) for out in tools("cache_dataset", args, copies=2)]
    print(f"\nlatents of each process: {[r['latents'] for r in results]}")  # both encoding: they overlapped
    assert all(r["latents"]["encoded"] + r["latents"]["reused"] == 40 for r in results)
    assert all(r["latents"]["encoded"] > 0 for r in results), "the two processes did not overlap"
    assert all_entries_valid(root) == 40 + 8 + 1  # 40 latents, 8 distinct captions, the empty caption
    assert cache(images, root, "--resolution", "64")["latents"]["encoded"] == 0


def test_sigkill_mid_cache_then_rerun_encodes_only_what_was_missing(cache, assets, tmp_path):
    from tools.embedded_default import build_images
    images = tmp_path / "many"
    build_images(images, count=60, size=128, seed=5)  # 60 encodes: the kill lands after 5, long before the last
    root = tmp_path / "cache"
    args = ["--checkpoint", str(assets["checkpoint"]), "--images", str(images), "--cache", str(root), "--resolution", "128"]
    proc = subprocess.Popen([*CACHE_TOOL, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def latent_rows():
        try:
            db = sqlite3.connect(root / "cache.sqlite", timeout=5)
            n = db.execute("SELECT COUNT(*) FROM entries WHERE kind='latent'").fetchone()[0]
            db.close()
            return n
        except sqlite3.Error:
            return 0
    wait_until(lambda: latent_rows() >= 5, 120)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    done_before = all_entries_valid(root)
    assert 0 < done_before < 60, "the kill should land mid-cache"
    rerun = cache(images, root, "--resolution", "128")
    assert rerun["latents"]["encoded"] == 60 - done_before
    assert rerun["latents"]["reused"] == done_before
    assert all_entries_valid(root) == 60 + 8 + 1  # latents, captions, the empty caption


def cache_only_workflow(folder: str, repeats: int = 1) -> dict:
    wf = {k: v for k, v in load_workflow().items() if k in {"1", "2", "3", "4"}}
    wf["2"]["inputs"].update(folder=folder, repeats=repeats)
    return wf


def counts(outcome, node: str) -> str:
    texts = [d["output"]["text"][0] for d in outcome.of_type("executed") if d["node"] == node]
    return texts[-1]


def test_cache_nodes_alone_report_encoded_and_reused(comfy, client):
    folder = comfy.dir("input", "cache_only")
    for f in (comfy.base_dir / "input" / "ingraph_example").iterdir():
        shutil.copy(f, folder / f.name)
    first = client.run(cache_only_workflow("cache_only"), timeout=300)
    assert first.ok, first.error
    second = client.run(cache_only_workflow("cache_only", repeats=2), timeout=300)  # re-runs the nodes
    assert second.ok
    assert counts(second, "3") == "latents: 0 encoded, 8 reused"
    assert counts(second, "4") == "text: 0 encoded, 8 reused"
    info = client.get("/ingraph/cache")
    assert info["entries"] >= 16 and info["bytes"] > 0 and info["datasets"]


def test_prune_removes_entries_no_dataset_uses(comfy, client):
    from tools.embedded_default import build_images
    folder = comfy.dir("input", "prune_me")
    build_images(folder, count=4, size=64, seed=1234)  # content no other dataset shares
    assert client.run(cache_only_workflow("prune_me"), timeout=300).ok
    victim = sorted(folder.glob("*.png"))[0]
    from PIL import Image
    img = Image.open(victim).convert("RGB")
    img.putpixel((1, 1), (9, 9, 9))
    img.save(victim)  # its old latent is no longer used by any dataset
    assert client.run(cache_only_workflow("prune_me"), timeout=300).ok
    before = client.get("/ingraph/cache")
    assert before["unused_entries"] >= 1
    pruned = client.post("/ingraph/cache/prune")
    assert pruned["removed"] >= 1 and pruned["after"]["unused_entries"] == 0


def test_three_aspect_ratios_train_in_one_bucket_per_batch(comfy, client):
    from tools.embedded_default import build_images
    folder = comfy.dir("input", "aspects")
    for name, size in (("square", (128, 128)), ("wide", (256, 128)), ("tall", (128, 256))):
        build_images(folder / name, count=4, size=size, seed=len(name))
        for f in (folder / name).iterdir():
            f.rename(folder / f"{name}_{f.name}")
        (folder / name).rmdir()
    wf = {k: v for k, v in load_workflow().items() if k in {"1", "2", "3", "4", "5", "6", "7"}}
    wf["2"]["inputs"].update(folder="aspects", resolution=128, bucketing=True, min_side=64, max_side=256)
    # fp32: bf16 convolutions on this CPU are several times slower, and precision is not what this test is about
    wf["6"]["inputs"].update(steps=8, batch_size=2, output_name="aspects_lora", precision="fp32")
    one = comfy.dir("input", "aspects_eval")
    for f in sorted(folder.glob("square_*"))[:2]:  # an image and its caption
        shutil.copy(f, one / f.name)
    evaluate_on_one_image(wf, folder="aspects_eval")  # evaluation (12 images up to 256 px, twice): not the point
    outcome = client.run(wf, timeout=600)
    assert outcome.ok, outcome.error
    steps = [m["data"]["event"] for m in outcome.messages
             if m.get("type") == "ingraph.event" and m["data"]["event"]["type"] == "step"]
    assert all(len(e["buckets"]) == 1 for e in steps)
    assert len({tuple(e["buckets"][0]) for e in steps}) >= 2, "all steps drew from one bucket only"
    loader = {"1": wf["1"], "20": {"class_type": "LoraLoader", "inputs": {
        "model": ["1", 0], "clip": ["1", 1], "lora_name": "aspects_lora.safetensors", "strength_model": 1.0,
        "strength_clip": 0.0}}}
    for k in ("8", "9", "10", "11", "12"):
        loader[k] = load_workflow()[k]
    loader["11"]["inputs"]["model"] = ["20", 0]
    loader["21"] = {"class_type": "PreviewImage", "inputs": {"images": ["12", 0]}}
    assert client.run(loader, timeout=300).ok
    assert "lora key not loaded" not in comfy.log_text()
