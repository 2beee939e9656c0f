"""Both streams of a joint audio-video model (LTX-2, MiniMax H3) on clips cached with their audio latents
(Batch.audio), trained as ComfyUI samples the nested latent that LTXV Concat AV Latent or Empty MiniMax H3 Latent AV
makes: the video and audio latents packed into one flat latent [B, 1, N] (comfy.utils.pack_latents, as the sampler
packs it), put through the model's process_latent_in with the latent shapes set on the model (as the sampler sets
them: MiniMax H3 then carries its audio scaled onto the video's noise schedule), noised at one sigma, and the model
handed the latent shapes to unpack them. The loss is the video stream's plus the audio stream's, each its own mean:
the audio latent is a few hundred values beside the video's tens of thousands, so one mean over both would all but
ignore it."""
from __future__ import annotations

import contextlib
import threading

import torch

from .base import Batch


# the latent shapes live on ComfyUI's model while a packed latent is prepared: one preparation at a time, as the
# evaluation's passes run side by side in threads
_SHAPES_SET = threading.RLock()


class AudioVideoStreams:
    """For a ModelFamily whose ComfyUI model takes a packed (video, audio) latent."""

    takes_audio = True

    def latent_shapes(self, batch: Batch) -> list[tuple]:
        """(video, audio) latent shapes of an audio-video batch, in the model's layout."""
        return [tuple(self.to_model_layout(batch.latents).shape), tuple(batch.audio.shape)]

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        # the latent shapes ComfyUI's sampler hands the model: [video, audio] for an audio-video sample, whose latent
        # comes packed, [video] for a one-latent (video-only) one
        shapes = self.latent_shapes(batch) if batch.audio is not None else [tuple(x_noisy.shape)]
        return {**super().extra_cond_inputs(batch, x_noisy), "latent_shapes": shapes}

    @contextlib.contextmanager
    def sampling_shapes(self, shapes: list[tuple]):
        """The latent shapes set on ComfyUI's model as its sampler sets them for a packed latent (inner_sample), which
        its process_latent_in and extra_conds read, and put back after."""
        model = self.base_model
        with _SHAPES_SET:
            before = getattr(model, "latent_shapes", None)
            model.latent_shapes = shapes
            try:
                yield
            finally:
                model.latent_shapes = before

    def audio_video_noising(self, batch: Batch):
        """noising's (x0, noise, sigma) for an audio-video batch: the streams packed into one flat latent and put
        through the model's process_latent_in as the sampler puts the packed latent image."""
        import comfy.utils
        video = self.to_model_layout(batch.latents.float())
        x0, shapes = comfy.utils.pack_latents([video, batch.audio.float().to(video.device)])
        noise, _ = comfy.utils.pack_latents([self.to_model_layout(batch.noise.float()),
                                             batch.audio_noise.float().to(video.device)])
        with self.sampling_shapes(shapes):
            x0 = self.base_model.process_latent_in(x0)
        return x0, noise, self.sigmas(batch.timesteps).to(x0.device)

    def audio_video_inputs(self, batch: Batch):
        """model_inputs' (x_in, timestep, kwargs) of an audio-video batch."""
        sampling, dtype = self.base_model.model_sampling, self.weight_dtype()
        x0, noise, sigma = self.audio_video_noising(batch)
        x_noisy = sampling.noise_scaling(sigma.view(-1, 1, 1), noise, x0)
        x_in = sampling.calculate_input(sigma.view(-1, 1, 1), x_noisy)
        with self.sampling_shapes(self.latent_shapes(batch)):
            kwargs = self.model_kwargs(batch, x_noisy, dtype)
        return x_in.to(dtype), sampling.timestep(sigma).float(), kwargs

    def audio_video_loss_of_output(self, out: torch.Tensor, batch: Batch, weighted: bool = True) -> torch.Tensor:
        """Per-sample loss of the model's packed output on an audio-video batch: each stream's own mean, summed."""
        import comfy.utils
        x0, noise, sigma = self.audio_video_noising(batch)
        shapes = self.latent_shapes(batch)
        video_out, audio_out = comfy.utils.unpack_latents(out, shapes)
        video_target, audio_target = comfy.utils.unpack_latents(self.target(x0, noise, sigma.view(-1, 1, 1)), shapes)
        mask = self.to_model_layout(batch.mask) if batch.mask is not None else None  # the video's pixels
        snr = self.snr(sigma)
        return self.training_loss(video_out, video_target, snr, weighted, mask) \
            + self.training_loss(audio_out, audio_target, snr, weighted)

    def run_streams(self, x_in: torch.Tensor, timestep: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """As ComfyUI's apply_model runs the model on a packed latent (streams_in), the list of outputs packed back."""
        streams, timestep, kwargs = self.streams_in(x_in, timestep, kwargs)
        out = self.diffusion_model(streams, timestep, transformer_options=self.transformer_options(kwargs), **kwargs)
        return streams_out(out)

    def streams_in(self, x_in: torch.Tensor, timestep: torch.Tensor, kwargs: dict):
        """What ComfyUI's apply_model hands the model for a packed latent: the latent unpacked into its list of
        streams by the latent shapes, the timestep put through the model class's process_timestep, and the other
        inputs (a copy, the shapes taken out)."""
        import comfy.utils
        kwargs = dict(kwargs)
        timestep = self.base_model.process_timestep(timestep, x=x_in, **kwargs)
        return comfy.utils.unpack_latents(x_in, kwargs.pop("latent_shapes")), timestep, kwargs


def streams_out(out) -> torch.Tensor:
    """The model's output as apply_model returns it: a list of streams packed back into one latent."""
    import comfy.utils
    return out if torch.is_tensor(out) else comfy.utils.pack_latents(out)[0]
