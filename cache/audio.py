"""The sound of video clips, for a model that generates video with audio (LTX-2): a clip item's audio track over the
item's own span, decoded and resampled with PyAV (as its frames are decoded), then encoded by the graph's audio VAE
as ComfyUI's LTXV Audio VAE Encode node encodes a clip's sound, and fitted to the number of audio latents ComfyUI's
LTXV Empty Latent Audio gives a video of the item's frames at its frame rate (what the model generates beside it).
"""
from __future__ import annotations

from pathlib import Path

from .pixels import shown
from .video import ClipError, clip_info


def is_audio_vae(vae) -> bool:
    """Whether a VAE is one of ComfyUI's audio VAEs that pair audio latents with video frames (LTX-2's, from Load
    LTXV Audio VAE), which say how many audio latents a video of some frames at some rate has."""
    return hasattr(getattr(vae, "first_stage_model", None), "num_of_latents_from_frames")


def audio_rate(vae) -> int:
    """The sample rate the audio VAE takes, as ComfyUI's VAE Encode Audio reads it."""
    return int(getattr(vae, "audio_sample_rate", 44100))


def load_clip_audio(path: str | Path, start_s: float, duration_s: float, rate: int):
    """The clip's sound from `start_s` seconds after its first video frame, for `duration_s` seconds, at `rate`:
    a float [channels, samples] tensor (mono stays mono, more channels are mixed to stereo) of exactly
    round(duration_s * rate) samples, silent where the track has no sound (it starts late or ends early).
    ClipError naming the file where it has no audio track or it cannot be decoded."""
    import av
    import numpy as np
    import torch
    info = clip_info(path)
    origin = info.first_pts * info.time_base + start_s  # where the item's first frame is on the file's clock
    wanted = round(duration_s * rate)
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise ClipError(f"clip {shown(path)} has no audio track")
            stream = container.streams.audio[0]
            layout = "mono" if stream.codec_context.channels == 1 else "stereo"
            resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
            if origin > 1.0:  # to the packet before the item's start, not through the whole track
                try:
                    container.seek(int(origin / float(stream.time_base)), stream=stream, backward=True)
                except av.error.FFmpegError:
                    pass  # a format that cannot seek is decoded from its start
            chunks, begins = [], None
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                if begins is None:
                    begins = float(frame.pts * frame.time_base)
                chunks += [out.to_ndarray() for out in resampler.resample(frame)]
                if begins + sum(c.shape[1] for c in chunks) / rate >= origin + duration_s:
                    break
            chunks += [out.to_ndarray() for out in resampler.resample(None)]
    except ClipError:
        raise
    except Exception as exc:  # PyAV raises its own error types for bad files
        raise ClipError(f"cannot decode the audio of {shown(path)}: {exc.__class__.__name__}: {exc}") from None
    channels = 1 if layout == "mono" else 2
    decoded = np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), dtype=np.float32)
    waveform = torch.zeros(channels, wanted)
    if begins is not None:
        offset = round((origin - begins) * rate)  # where the item starts in what was decoded (< 0: before it)
        lo, hi = max(offset, 0), min(offset + wanted, decoded.shape[1])
        if hi > lo:
            waveform[:, lo - offset:hi - offset] = torch.from_numpy(np.ascontiguousarray(decoded[:, lo:hi]))
    return waveform


def encode_clip_audio(vae, waveform, frames: int, fps: float):
    """The audio latent [C, T, F] of one item's sound ([channels, samples] at audio_rate(vae)), encoded as ComfyUI's
    VAE Encode Audio encodes it, with T fitted to the audio latents ComfyUI's LTXV Empty Latent Audio makes for
    `frames` frames at `fps` (trimmed, or padded with zeros as LTXV Concat AV Latent pads a short one)."""
    import torch
    latent = vae.encode(waveform.unsqueeze(0).movedim(1, -1))[0].float()  # VAE.encode takes [B, samples, channels]
    count = int(vae.first_stage_model.num_of_latents_from_frames(frames, fps))
    if latent.shape[1] >= count:
        return latent[:, :count].contiguous()
    pad = torch.zeros(latent.shape[0], count - latent.shape[1], *latent.shape[2:], dtype=latent.dtype)
    return torch.cat([latent, pad], dim=1)
