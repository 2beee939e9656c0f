"""Fill the cache for a folder of images outside a ComfyUI server, with the library code the cache nodes use.

    python tools/cache_dataset.py --checkpoint CKPT --images DIR --cache ROOT [--resolution 64 --bucketing]
        [--vae VAE_FILE] [--background '#ffffff'] [--masks 'mask files'|'alpha channel'|off]
        [--caption-dropout 0.1] [--caption-variants 4 --keep-tags 1]
Prints one JSON line: {"latents": {"encoded": n, "reused": m}, "text": {...}, "seconds": s}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.bootstrap import bootstrap  # noqa: E402


def load_encoders(checkpoint: Path, vae_file: Path | None = None):
    bootstrap()
    import comfy.sd
    import comfy.utils
    _, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(checkpoint), output_model=False)
    if vae_file is not None:
        vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(vae_file)))
    return clip, vae


def encode_folder(images: Path, cache_root: Path, clip, vae, resolution: int = 64, bucketing: bool = False,
                  text: bool = True, background: str = "#ffffff", **features):
    """Scans and caches a folder as the cache nodes do; returns (cached dataset, counts and seconds). `features`:
    Load Training Images' masks, caption_dropout, caption_variants and keep_tags (scan_image_folder's)."""
    from ingraph_trainer.cache.buckets import BucketSettings
    from ingraph_trainer.cache.folder_scan import scan_image_folder
    from ingraph_trainer.cache.encoding import encode_latents, encode_text, record_usage
    from ingraph_trainer.cache.store import CacheStore
    t0 = time.perf_counter()
    store = CacheStore(cache_root)
    dataset = scan_image_folder(images, buckets=BucketSettings(resolution=resolution, enabled=bucketing, min_side=64,
                                                               max_side=4 * resolution), background=background,
                                **features)
    try:
        with store.caching_pass():  # a prune meanwhile keeps what this pass reads and writes
            dataset, le, lr = encode_latents(dataset, vae, store)
            result = {"latents": {"encoded": le, "reused": lr}}
            if text:
                dataset, te, tr = encode_text(dataset, clip, store)
                result["text"] = {"encoded": te, "reused": tr}
            record_usage(dataset, store)
    finally:
        store.close()
    result["seconds"] = time.perf_counter() - t0
    return dataset, result


def cache_folder(images: Path, cache_root: Path, clip, vae, resolution: int = 64, bucketing: bool = False,
                 text: bool = True, background: str = "#ffffff", **features) -> dict:
    return encode_folder(images, cache_root, clip, vae, resolution, bucketing, text, background, **features)[1]


def add_feature_flags(parser: argparse.ArgumentParser):
    """Load Training Images' options for masks and captions, as command-line flags (see dataset_features)."""
    from ingraph_trainer.cache.folder_scan import MASK_SOURCES
    parser.add_argument("--masks", choices=MASK_SOURCES, default="mask files",
                        help="where loss masks come from: NAME.mask.png beside each image, its alpha channel, or off")
    parser.add_argument("--caption-dropout", type=float, default=0.0,
                        help="share of training samples that see the empty caption (cached once)")
    parser.add_argument("--caption-variants", type=int, default=0, help="tag-shuffled variants cached per caption")
    parser.add_argument("--keep-tags", type=int, default=0, help="leading tags kept in place when shuffling")


def dataset_features(opts) -> dict:
    return {"masks": opts.masks, "caption_dropout": opts.caption_dropout, "caption_variants": opts.caption_variants,
            "keep_tags": opts.keep_tags}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--vae", type=Path, default=None, help="a VAE file to use instead of the checkpoint's")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--bucketing", action="store_true")
    parser.add_argument("--background", default="#ffffff", help="colour transparent pixels are composited on")
    bootstrap()  # the flags' choices come from the pack
    add_feature_flags(parser)
    opts = parser.parse_args(argv)
    clip, vae = load_encoders(opts.checkpoint, opts.vae)
    print(json.dumps(cache_folder(opts.images, opts.cache, clip, vae, opts.resolution, opts.bucketing,
                                  background=opts.background, **dataset_features(opts))), flush=True)


if __name__ == "__main__":
    main()
