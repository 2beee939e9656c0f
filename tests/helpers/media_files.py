"""Media files the video tests write: clips whose frame k is a flat grey of a known level, frame folders and flat
images, all SIDE pixels square (tests/unit/test_video_data.py, tests/comfyui/test_video_families.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

SIDE = 64


def time_ramp(t):
    """A stereo sound that says when it is: the left channel is t / 10 (seconds), the right its negative."""
    return np.stack([t / 10.0, -t / 10.0])


def write_video(path: Path, frames: int, fps: int = 8, codec: str = "libx264", keyframe_every: int = 250,
                sound=None, sound_s: float | None = None, audio_codec: str = "pcm_s16le", audio_rate: int = 48000,
                sound_starts_s: float = 0.0):
    """A clip whose frame k is a flat grey of level 5 * k (so a decoded frame says which frame it is); with `sound`
    (seconds → [channels, samples] in -1..1, time_ramp say; 1, 2 or 6 channels) an audio track of sound_s seconds
    (the clip's length unless given) from sound_starts_s on, beside it, lossless by default (PCM; .mkv or .mov) so
    decoded samples say when they were."""
    import av
    with av.open(str(path), "w") as container:
        audio = None
        if sound is not None:
            layout = {1: "mono", 2: "stereo", 6: "5.1"}[len(sound(np.zeros(1)))]
            audio = container.add_stream(audio_codec, rate=audio_rate, layout=layout)
        stream = container.add_stream(codec, rate=fps)
        stream.width = stream.height = SIDE
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "0", "preset": "ultrafast", "g": str(keyframe_every),
                              "keyint_min": str(keyframe_every)}
        for k in range(frames):
            image = np.full((SIDE, SIDE, 3), 5 * k, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
        if audio is not None:
            total = round((frames / fps if sound_s is None else sound_s) * audio_rate)
            chunk = 1024 if audio_codec == "aac" else 4000  # AAC encodes frames of 1024 samples
            delay = round(sound_starts_s * audio_rate)
            for at in range(0, total, chunk):
                samples = sound((delay + np.arange(at, min(at + chunk, total))) / audio_rate).astype(np.float32)
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp",
                                                   layout=audio.layout.name)
                frame.sample_rate, frame.pts = audio_rate, delay + at
                container.mux(audio.encode(frame))
            container.mux(audio.encode())
    return path


def write_frames(folder: Path, frames: int, level=lambda k: 10 * k):
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(frames):
        Image.new("RGB", (SIDE, SIDE), (level(k),) * 3).save(folder / f"{k:04d}.png")
    return folder


def write_image(path: Path, level: int = 128, size=(SIDE, SIDE)):
    from PIL import Image
    Image.new("RGB", size, (level, 40, 200)).save(path)
    return path


def cached_captions(folder: Path, clip, captions: dict[str, str], latent_channels: int = 4, video: bool = False):
    """A folder of one flat image per caption (name.png beside name.txt), cached through the pack's own Cache Latents
    (a stand-in VAE giving zero latents: the captions are the point; a video VAE's one-frame [C, 1, H, W] for a video
    model) and Cache Text Embeddings with `clip`: (the graph's dataset, the trainer's CachedDataset of its manifest,
    item index by name)."""
    import torch
    from PIL import Image

    from ingraph_trainer.cache.buckets import BucketSettings
    from ingraph_trainer.cache.encoding import encode_latents, encode_text
    from ingraph_trainer.cache.folder_scan import scan_image_folder
    from ingraph_trainer.cache.store import CacheStore, write_manifest
    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    images = folder / "images"
    images.mkdir()
    for name, caption in captions.items():
        Image.new("RGB", (SIDE, SIDE), (90, 40, 200)).save(images / f"{name}.png")
        (images / f"{name}.txt").write_text(caption)

    class VAE:
        def get_sd(self):
            return {"w": torch.ones(1)}

        def encode(self, pixels):
            return torch.zeros(1, latent_channels, *(1,) * video, 8, 8)
    store = CacheStore(folder / "cache")
    dataset = scan_image_folder(images, buckets=BucketSettings(resolution=SIDE, enabled=False))
    dataset, _, _ = encode_latents(dataset, VAE(), store)
    dataset, _, _ = encode_text(dataset, clip, store)
    store.close()
    cached = load_cached_dataset(str(write_manifest(folder / "m.json", dataset, folder / "cache")))
    return dataset, cached, {Path(s).stem: i for i, s in enumerate(cached.sources)}


class StandInAudioVAE:
    """Stands in for LTX-2's audio VAE as ComfyUI's Load LTXV Audio VAE gives it, whose encode needs torchaudio (no
    wheel matches this machine's torch): the same interface and the same input handling (encode takes [B, samples,
    channels] at 44.1 kHz and, as ComfyUI's VAE.encode does, crops the samples to whole blocks of 4096 from both
    ends; first_stage_model says how many latents a video's frames have), 25 latents a second of 8 channels by 16
    bins, each the mean of its window's first channel, so a latent says which sound it was made of."""
    audio_sample_rate = 44100
    latent_channels = 8
    latents_per_second = 25
    crop_input = True
    downscale_ratio = 4096

    def __init__(self):
        import types
        self.encoded = []  # the shape of each encode call's waveform, as given
        per_second = self.latents_per_second
        self.first_stage_model = types.SimpleNamespace(
            latent_frequency_bins=16,
            num_of_latents_from_frames=lambda frames, fps: round(float(frames) / fps * per_second))

    def spacial_compression_encode(self):
        return self.downscale_ratio

    def get_sd(self):
        import torch
        return {"stand_in_audio_vae": torch.tensor([float(self.audio_sample_rate)])}

    def encode(self, audio):
        self.encoded.append(tuple(audio.shape))
        kept = audio.shape[1] // self.downscale_ratio * self.downscale_ratio  # vae_encode_crop_pixels
        audio = audio.narrow(1, (audio.shape[1] % self.downscale_ratio) // 2, kept)
        hop = round(self.audio_sample_rate / self.latents_per_second)
        usable = audio.shape[1] // hop * hop
        windows = audio[:, :usable, 0].reshape(audio.shape[0], -1, hop).mean(-1)
        return windows[:, None, :, None].expand(-1, self.latent_channels, -1, 16).clone()


class StandInMiniMaxAudioVAE(StandInAudioVAE):
    """Stands in for MiniMax H3's audio VAE as ComfyUI's Load VAE gives it (the real one is hundreds of millions of
    parameters): the same interface and input handling (encode takes [B, samples, channels] at 32 kHz, mono
    repeated to stereo, cropped to whole blocks of 800 samples from both ends; first_stage_model makes 40 latents a
    second), latents [B, 32, stereo, T], each the mean of its window in its own channel."""
    audio_sample_rate = 32000
    latent_channels = 32
    latents_per_second = 40
    downscale_ratio = 800

    def __init__(self):
        import types
        self.encoded = []
        self.first_stage_model = types.SimpleNamespace(latents_per_second=self.latents_per_second)

    def get_sd(self):
        import torch
        return {"stand_in_minimax_audio_vae": torch.tensor([float(self.audio_sample_rate)])}

    def encode(self, audio):
        self.encoded.append(tuple(audio.shape))
        if audio.shape[-1] == 1:  # ComfyUI's "replicate" padding of the channels
            audio = audio.repeat(1, 1, 2)
        kept = audio.shape[1] // self.downscale_ratio * self.downscale_ratio  # vae_encode_crop_pixels
        audio = audio.narrow(1, (audio.shape[1] % self.downscale_ratio) // 2, kept)
        windows = audio.reshape(audio.shape[0], -1, self.downscale_ratio, 2).mean(2)  # [B, T, stereo]
        return windows.movedim(1, -1)[:, None].expand(-1, self.latent_channels, -1, -1).clone()


class StandInMiniMaxVideoVAE:
    """Stands in for MiniMax H3's video VAE (its real one is hundreds of millions of parameters): 24 latent
    channels, 16x in space, and in time as ComfyUI's MiniMax H3 nodes count it (5 frames make 2 latent frames, each
    17 more 5 more); each latent the mean of its frames' pixels, so a latent says which frames it was made of."""
    latent_dim = 3

    def get_sd(self):
        import torch
        return {"stand_in_minimax_video_vae": torch.ones(1)}

    def encode(self, pixels):  # [T, H, W, 3] -> [1, 24, latent frames, H / 16, W / 16]
        import torch
        frames = pixels.shape[0]
        latent_frames = 2 if frames <= 5 else (frames - 5) // 17 * 5 + 2
        pooled = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1), 16).mean(1)  # [T, h, w]
        chunks = torch.tensor_split(pooled, latent_frames)
        return torch.stack([c.mean(0) for c in chunks])[None, None].expand(1, 24, -1, -1, -1).clone()
