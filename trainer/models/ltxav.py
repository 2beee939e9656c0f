"""LTX-2 (ComfyUI 0.33's `LTXAV`): LTX-Video's rectified flow on 128-channel video latents, in blocks that carry a
video stream and an audio stream side by side, with cross-attention between them; the text (Gemma 3's layers,
projected) goes through the model's own connectors into a video and an audio context.

The trainer trains it on video (and images, as one-frame videos) with no audio latents, as ComfyUI samples it from
a video latent alone: the audio stream is then empty, so ComfyUI's blocks skip their audio attention, audio
feed-forward and the cross-attention between the two. The adapter presets select the video stream's layers only
(`attn1`, `attn2`, `ff`; not `audio_attn1`, `audio_ff`, `audio_to_video_attn`, ...), which is what a video-only
batch gives gradients to. Training the audio stream needs audio latents (ComfyUI's LTX-2 audio VAE) in the
batches, which the cache does not make yet.

ComfyUI 0.3.64 has no LTX-2: there this family matches nothing."""
from __future__ import annotations

import torch

from .base import Batch, ModelFamily, UnsupportedSetting, is_comfy_model
from .ltxv import LTXVFamily
from .residuals import residuals_out_of_place


class LTXAVFamily(LTXVFamily):
    name = "ltxav"
    display_name = "LTX-2"
    base_model_version = "ltxav"
    # ComfyUI reads LTX-2's sizes from the file's "config" metadata (what Lightricks' files carry), which a file of
    # random weights would have to write too: tools/family_coverage.py builds the tiny one with ComfyUI's get_model.
    # So no builder here (LTX-Video's would build an LTX-Video)
    scratch_sizes = {}
    scratch_state_dict = vars(ModelFamily)["scratch_state_dict"]

    @classmethod
    def matches(cls, base_model) -> bool:
        return is_comfy_model(base_model, "LTXAV")

    def prepare_for_training(self) -> None:
        super(LTXVFamily, self).prepare_for_training()
        # its blocks add into the (video, audio) pair they receive in place, first thing (vx.addcmul_): each block
        # takes copies, so what a checkpointed block recomputes from is still its input
        residuals_out_of_place(self.checkpoint_blocks(), copy_inputs=True)

    def pipeline_layers(self):
        raise UnsupportedSetting("distributed.pipeline_stages: LTX-2's blocks carry video and audio together and do "
                                 "not split into pipeline stages yet; use 1 stage (ZeRO spreads the model instead)")

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        model = self.diffusion_model
        # ComfyUI's LTX-2 text encoders mark their output unprocessed (it goes through the model's connectors),
        # but for the old single-file encoder with connectors of its own (its compat mode), whose output is the
        # connectors' already: two contexts side by side, 2 x caption_channels wide. The cache keeps the
        # embedding, not the mark, which the width tells apart
        processed = batch.cond.shape[-1] == 2 * model.caption_channels
        # the latent shapes ComfyUI's sampler hands a one-latent (video-only) sample: the model takes [video]
        return {**super().extra_cond_inputs(batch, x_noisy), "unprocessed_ltxav_embeds": not processed,
                "latent_shapes": [tuple(x_noisy.shape)]}

    def run_model(self, x_in: torch.Tensor, timestep: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """As ComfyUI's apply_model runs LTX-2: the latent unpacked into its list of streams (video alone here), the
        timestep made the (video, audio) pair by the model class's process_timestep."""
        import comfy.utils
        kwargs = dict(kwargs)
        timestep = self.base_model.process_timestep(timestep, x=x_in, **kwargs)
        x_in = comfy.utils.unpack_latents(x_in, kwargs.pop("latent_shapes"))
        return self.diffusion_model(x_in, timestep, transformer_options=self.transformer_options(kwargs), **kwargs)
