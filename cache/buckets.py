"""Aspect-ratio buckets: sizes in steps of 64 around a target area, and where each image goes."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

STEP = 64


@dataclass(frozen=True)
class BucketSettings:
    resolution: int = 512  # target area is resolution x resolution
    enabled: bool = True
    min_side: int = 256
    max_side: int = 1024
    max_upscale: float = 1.0  # an image is never enlarged more than this factor
    crop: str = "center"  # or "random" (a fixed random box per image, so the cache stays valid)
    flip: bool = False  # also train on the horizontally flipped image

    def as_key(self) -> dict:
        return {"resolution": self.resolution, "bucketing": self.enabled, "min_side": self.min_side,
                "max_side": self.max_side, "max_upscale": self.max_upscale}


def candidate_buckets(area: int, min_side: int, max_side: int) -> list[tuple[int, int]]:
    out = set()
    for w in range(max(STEP, min_side - min_side % STEP), max_side + 1, STEP):
        h = (area // w) // STEP * STEP
        if min_side <= h <= max_side and w >= min_side:
            out.add((w, h))
            out.add((h, w))
    return sorted(out)


def bucket_for(width: int, height: int, s: BucketSettings) -> tuple[int, int]:
    """(bucket width, bucket height) for an image of this size."""
    if not s.enabled:
        return s.resolution, s.resolution
    area = s.resolution * s.resolution
    # no upscaling beyond the limit: a small image gets a smaller area
    area = int(min(area, width * height * s.max_upscale ** 2))
    area = max(area, s.min_side * s.min_side)
    candidates = candidate_buckets(area, s.min_side, s.max_side) or [(s.min_side, s.min_side)]
    aspect = math.log(width / height)
    return min(candidates, key=lambda b: (abs(math.log(b[0] / b[1]) - aspect), -b[0] * b[1]))


def crop_box(width: int, height: int, bucket: tuple[int, int], crop: str, digest: str):
    """Resize scale and crop box (left, top) in resized pixels; random crops are fixed per image content."""
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    if crop == "random":
        r = int(hashlib.sha256(digest.encode()).hexdigest()[:8], 16)
        left, top = r % (rw - bw + 1), (r // 7919) % (rh - bh + 1)
    else:
        left, top = (rw - bw) // 2, (rh - bh) // 2
    return (rw, rh), (left, top)
