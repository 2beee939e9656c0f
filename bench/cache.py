"""Cache benchmark.

1. Real encodes with the tiny checkpoint's VAE and CLIP: the first and the second run of caching the
   same dataset, and their ratio (target: the second run at least 20 times faster).
2. A synthetic cache index of 100,000 entries: the time to open the dataset (the trainer's manifest
   read) and iterate an epoch of batch indices (target under 2 s), and the memory it takes (target
   under 200 MB).

    python bench/cache.py [--images 64 --size 256 --entries 100000]
The last line holds the ratio of run times.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.cache_dataset import cache_folder, load_encoders  # noqa: E402
from tools.embedded_default import build_checkpoint, build_images  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def synthetic_index(entries: int, tmp: Path):
    import random
    from ingraph_trainer.cache.shards import MANIFEST_VERSION
    from ingraph_trainer.trainer.data.loading import StepSampler, load_cached_dataset
    rng = random.Random(0)
    buckets = [(512, 512), (576, 448), (448, 576), (640, 384), (384, 640)]
    items = []
    for n in range(entries):
        w, h = buckets[n % len(buckets)]
        items.append([f"/data/img_{n:06d}.png", "", f"{rng.getrandbits(256):064x}", f"{rng.getrandbits(256):064x}",
                      f"{rng.getrandbits(256):064x}", f"{rng.getrandbits(256):064x}", w, h, False])
    manifest = tmp / "manifest.json"
    manifest.write_text(json.dumps({"version": MANIFEST_VERSION, "cache_root": str(tmp), "folder": "/data",
                                    "repeats": 1, "fields": ["source", "caption", "latent", "latent_sha256", "text",
                                                             "text_sha256", "width", "height", "flip"],
                                    "items": items}, separators=(",", ":")))
    del items
    gc.collect()

    def open_and_iterate():
        t0 = time.perf_counter()
        dataset = load_cached_dataset(str(manifest))
        t_open = time.perf_counter() - t0
        sampler = StepSampler(dataset.buckets, global_batch=8, seed=0)
        seen = sum(len(sampler.indices(step)) for step in range(sampler.batches_per_epoch))
        assert seen >= entries
        return dataset, sampler, t_open, time.perf_counter() - t0

    rss0 = rss_mb()
    dataset, sampler, t_open, t_total = open_and_iterate()  # timed without the tracer's overhead
    held = rss_mb() - rss0
    del dataset, sampler
    gc.collect()
    tracemalloc.start()
    kept = open_and_iterate()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del kept
    return t_open, t_total, peak / 2**20, held, entries // 8


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--entries", type=int, default=100_000)
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ingraph-cache-bench-") as tmp:
        tmp = Path(tmp)
        ckpt = build_checkpoint(tmp / "tiny.safetensors")
        build_images(tmp / "images", count=opts.images, size=opts.size)
        clip, vae = load_encoders(ckpt)
        first = cache_folder(tmp / "images", tmp / "cache", clip, vae, resolution=opts.size)
        second = cache_folder(tmp / "images", tmp / "cache", clip, vae, resolution=opts.size)
        assert second["latents"]["encoded"] == 0 and second["text"]["encoded"] == 0
        t_open, t_total, peak, held, batches = synthetic_index(opts.entries, tmp)
    print(f"dataset: {opts.images} images of {opts.size}x{opts.size}, tiny SD1.5 TAESD VAE + CLIP-L, CPU")
    print(f"first run (encode everything): {first['seconds']:.2f} s, second run (all reused): {second['seconds']:.3f} s")
    print(f"synthetic index of {opts.entries} entries: open {t_open:.2f} s, open + epoch of {batches} batches "
          f"{t_total:.2f} s (target < 2 s); memory: peak traced {peak:.0f} MB, held after {held:.0f} MB "
          f"(target < 200 MB)")
    print(f"ratio first/second run: {first['seconds'] / second['seconds']:.1f}x (target >= 20x)")


if __name__ == "__main__":
    main()
