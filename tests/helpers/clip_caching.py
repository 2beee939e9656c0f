"""Caching clips in unit tests: the folder scan with a clip's defaults, and stand-ins for a video VAE and a CLIP
(tests/unit/test_video_data.py, test_clip_audio.py)."""
from __future__ import annotations

import torch

from media_files import SIDE


def scan(folder, **kw):
    from ingraph_trainer.cache.buckets import BucketSettings
    from ingraph_trainer.cache.folder_scan import scan_image_folder
    kw.setdefault("buckets", BucketSettings(resolution=SIDE, enabled=False))
    return scan_image_folder(folder, missing_caption="use default caption", default_caption="a clip", **kw)


class VideoVAE:
    """Stands in for a ComfyUI video VAE (latent_dim 3, 4x in time, 8x in space); counts what it encodes."""
    latent_dim = 3

    def __init__(self):
        self.encoded = []  # frame count of each encode call

    def get_sd(self):
        return {"w": torch.ones(3)}

    def encode(self, pixels):  # [T, H, W, 3] -> [1, 4, 1 + (T - 1) // 4, H / 8, W / 8], the mean of each block
        self.encoded.append(pixels.shape[0])
        t = 1 + (pixels.shape[0] - 1) // 4
        video = pixels.movedim(-1, 0)[:, :1 + 4 * (t - 1):4]  # the frame each latent frame starts with
        pooled = torch.nn.functional.avg_pool2d(video.reshape(-1, *video.shape[2:]), 8)
        return pooled.reshape(3, t, *pooled.shape[-2:])[:1].repeat(4, 1, 1, 1).unsqueeze(0)


class SyntheticClip:
    """Stands in for a ComfyUI CLIP: an embedding from the caption's length."""
    layer_idx = None

    def get_sd(self):
        return {"w": torch.zeros(2)}

    def tokenize(self, text):
        return text

    def encode_from_tokens(self, text, return_pooled=True, return_dict=True):
        return {"cond": torch.full((1, 3, 8), float(len(text))), "pooled_output": None}
