"""The sound of video clips, for a model that generates video with audio (LTX-2, MiniMax H3): a clip item's audio
track over the item's own span, decoded and resampled with PyAV (as its frames are decoded), then encoded by the
graph's audio VAE as ComfyUI's audio VAE encode nodes encode a clip's sound, and fitted to the number of audio latents
ComfyUI's empty audio-video latents give a video of the item's frames at its frame rate (what the model generates
beside it: LTXV Empty Latent Audio's count, Empty MiniMax H3 Latent AV's).
"""
from __future__ import annotations

import math
from pathlib import Path

from .pixels import shown
from .video import ClipError, clip_info

# how far before an item's start decoding begins after a seek: a compressed track's first frame after a seek point
# decodes wrong without the one before it (AAC's overlapping windows)
SEEK_MARGIN_S = 0.5


def counts_by_frames(vae) -> bool:
    """Whether the audio VAE is LTX-2's (Load LTXV Audio VAE), which says how many audio latents a video of some
    frames at some rate has; MiniMax H3's makes a fixed number of latents a second."""
    return hasattr(getattr(vae, "first_stage_model", None), "num_of_latents_from_frames")


def is_audio_vae(vae) -> bool:
    """Whether a VAE is one of ComfyUI's audio VAEs that pair audio latents with video frames: LTX-2's or MiniMax
    H3's (counts_by_frames)."""
    return counts_by_frames(vae) or hasattr(getattr(vae, "first_stage_model", None), "latents_per_second")


def audio_rate(vae) -> int:
    """The sample rate the audio VAE takes, as ComfyUI's VAE Encode Audio reads it."""
    return int(getattr(vae, "audio_sample_rate", 44100))


def audio_latent_count(vae, frames: int, fps: float) -> int:
    """The audio latents beside `frames` video frames at `fps`: as many as LTXV Empty Latent Audio makes (LTX-2), or
    as Empty MiniMax H3 Latent AV makes for that duration (40 a second, rounded)."""
    model = vae.first_stage_model
    if counts_by_frames(vae):
        return int(model.num_of_latents_from_frames(frames, fps))
    return round(frames / fps * model.latents_per_second)


def audio_time_axis(vae) -> int:
    """The time axis of one item's audio latent as the VAE gives it: LTX-2's [C, T, bins] (1), MiniMax H3's
    [C, stereo, T] (the last)."""
    return 1 if counts_by_frames(vae) else -1


def audio_timing_problem(vae, frames: int, fps: float) -> str | None:
    """Why items of `frames` frames at `fps` cannot carry this audio VAE's latents as its model generates them, or
    None. MiniMax H3 generates 24 fps video of 17k + 5 frames (Empty MiniMax H3 AV Latent snaps to them) and places
    its video and audio latents in time by that rate."""
    if not counts_by_frames(vae) and (fps != 24 or frames % 17 != 5):
        return (f"its {frames}-frame items at {fps:g} fps: MiniMax H3 generates 24 fps video of 5, 22, 39, ... (17k "
                "+ 5) frames, its sound timed by them; set fps to 24 and frame_buckets to such counts")
    return None


def encoded_block(vae) -> int:
    """The samples ComfyUI's VAE.encode takes a waveform in multiples of: it crops the rest away, from both ends
    (vae_encode_crop_pixels, with the VAE's downscale ratio: 4096 for LTX-2's), so a waveform of whole blocks
    reaches the encoder as it is."""
    if not getattr(vae, "crop_input", False):
        return 1
    return max(1, int(vae.spacial_compression_encode()))


def load_clip_audio(path: str | Path, start_s: float, duration_s: float, rate: int, samples: int | None = None):
    """The clip's sound from `start_s` seconds after its first video frame, for `duration_s` seconds (or `samples`
    samples), at `rate`: a float [channels, samples] tensor (mono stays mono, more channels are mixed to stereo),
    silent where the track has no sound (it starts late or ends early). ClipError naming the file where it has no
    audio track or it cannot be decoded."""
    import av
    import numpy as np
    import torch
    info = clip_info(path)
    origin = info.first_pts * info.time_base + start_s  # where the item's first frame is on the file's clock
    wanted = round(duration_s * rate) if samples is None else samples
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise ClipError(f"clip {shown(path)} has no audio track")
            stream = container.streams.audio[0]
            layout = "mono" if stream.codec_context.channels == 1 else "stereo"
            resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
            if origin > SEEK_MARGIN_S:  # to a packet before the item's start, not through the whole track
                try:
                    container.seek(int((origin - SEEK_MARGIN_S) / float(stream.time_base)), stream=stream,
                                   backward=True)
                except av.error.FFmpegError:
                    pass  # a format that cannot seek is decoded from its start
            chunks, begins = [], None
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                if begins is None:
                    begins = float(frame.pts * frame.time_base)
                chunks += [out.to_ndarray() for out in resampler.resample(frame)]
                if begins + sum(c.shape[1] for c in chunks) / rate >= origin + wanted / rate:
                    break
            chunks += [out.to_ndarray() for out in resampler.resample(None)]
    except ClipError:
        raise
    except Exception as exc:  # PyAV raises its own error types for bad files
        raise ClipError(f"cannot decode the audio of {shown(path)}: {exc.__class__.__name__}: {exc}") from None
    if begins is None:  # nothing to place on the clip's clock: an empty track, or one without timestamps
        raise ClipError(f"clip {shown(path)}: its audio track holds no timed sound")
    channels = 1 if layout == "mono" else 2
    decoded = np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), dtype=np.float32)
    waveform = torch.zeros(channels, wanted)
    offset = round((origin - begins) * rate)  # where the item starts in what was decoded (< 0: before it)
    lo, hi = max(offset, 0), min(offset + wanted, decoded.shape[1])
    if hi > lo:
        waveform[:, lo - offset:hi - offset] = torch.from_numpy(np.ascontiguousarray(decoded[:, lo:hi]))
    return waveform


def clip_audio_latent(vae, path: str | Path, start: int, frames: int, fps: float):
    """The audio latent (LTX-2's [C, T, F], MiniMax H3's [C, 2, T]) of a clip item (`frames` frames from frame
    `start` at `fps`): its sound, read on in whole blocks of what the VAE encodes (encoded_block: the sound after
    the item's end, not a crop of its own) and encoded as ComfyUI's VAE Encode Audio encodes it, then the latents of
    its own span kept: as many as audio_latent_count gives its frames (padded with zeros, as LTXV Concat AV Latent
    pads a short one, only where the encoder gives fewer). Errors name the file."""
    import torch
    rate, count = audio_rate(vae), audio_latent_count(vae, frames, fps)
    block = encoded_block(vae)
    samples = math.ceil(round(frames / fps * rate) / block) * block
    sound = load_clip_audio(path, start / fps, frames / fps, rate, samples=samples)
    try:
        latent = vae.encode(sound.unsqueeze(0).movedim(1, -1))[0].float()  # VAE.encode takes [B, samples, channels]
    except Exception as exc:  # noqa: BLE001 - the VAE's own error, named by the clip
        raise ClipError(f"clip {shown(path)}: the audio VAE could not encode its sound from frame {start}: "
                        f"{exc.__class__.__name__}: {exc}") from exc
    axis = audio_time_axis(vae) % latent.dim()
    if latent.shape[axis] >= count:
        return latent.narrow(axis, 0, count).contiguous()
    pad = list(latent.shape)
    pad[axis] = count - latent.shape[axis]
    return torch.cat([latent, torch.zeros(pad, dtype=latent.dtype)], dim=axis)
