"""LTX-2 (ComfyUI 0.33's `LTXAV`): LTX-Video's rectified flow on 128-channel video latents, in blocks that carry a
video stream and an audio stream side by side, with cross-attention between them; the text (Gemma 3's layers,
projected) goes through the model's own connectors into a video and an audio context.

On video alone (clips cached without an audio VAE, and images as one-frame videos) the trainer runs it as ComfyUI
samples it from a video latent alone: the audio stream is then empty, so ComfyUI's blocks skip their audio
attention, audio feed-forward and the cross-attention between the two, and the adapter presets select the video
stream's layers only (`attn1`, `attn2`, `ff`), which is all a video-only batch gives gradients to.

On clips cached with LTX-2's audio VAE (their audio latents in Batch.audio) it trains both streams, as ComfyUI
samples an audio-video latent (LTXVConcatAVLatent's: audio_video.py). The presets then add the audio stream's layers
and the cross-attention between the streams.

ComfyUI 0.3.64 has no LTX-2: there this family matches nothing."""
from __future__ import annotations

import torch

from .audio_video import AudioVideoStreams, streams_out
from .base import Batch, ModelFamily, is_comfy_model
from .ltxv import LTXVFamily
from .residuals import residuals_out_of_place
from .stages import StageInput, ends_here, floats, holding_all_but, packed, unpacked

# the audio stream's layers, and the cross-attention between the two streams, which an audio-video batch trains
AUDIO_ATTENTION = (r"transformer_blocks\.\d+\.(audio_attn[12]|audio_to_video_attn|video_to_audio_attn)\."
                   r"(to_q|to_k|to_v|to_out\.0)$",)
AUDIO_FEED_FORWARD = (r"transformer_blocks\.\d+\.audio_ff\.net\.(0\.proj|2)$",)


class LTXAVFamily(AudioVideoStreams, LTXVFamily):
    text_input_layer = None  # its text reaches the blocks through its own connectors (extra_conds), not LTX-Video's
    name = "ltxav"
    display_name = "LTX-2"
    base_model_version = "ltxav"
    # ComfyUI reads LTX-2's sizes from the file's "config" metadata (what Lightricks' files carry), which a file of
    # random weights would have to write too: tools/family_coverage.py builds the tiny one with ComfyUI's get_model.
    # So no builder here (LTX-Video's would build an LTX-Video)
    scratch_sizes = {}
    scratch_state_dict = vars(ModelFamily)["scratch_state_dict"]
    # the audio stream's layers each preset adds where the run's clips carry audio
    audio_target_patterns = {"attention": AUDIO_ATTENTION, "attention_ff": AUDIO_ATTENTION + AUDIO_FEED_FORWARD}
    trains_audio = False  # whether the run's clips carry audio latents (read_dataset)

    @classmethod
    def matches(cls, base_model) -> bool:
        return is_comfy_model(base_model, "LTXAV")

    def read_dataset(self, dataset) -> None:
        from ..data.dataset_checks import has_audio
        super().read_dataset(dataset)
        self.trains_audio = has_audio(dataset)

    def preset_patterns(self, preset: str) -> tuple[str, ...]:
        return super().preset_patterns(preset) + (self.audio_target_patterns[preset] if self.trains_audio else ())

    def prepare_for_training(self) -> None:
        super(LTXVFamily, self).prepare_for_training()
        # its blocks add into the (video, audio) pair they receive in place, first thing (vx.addcmul_): each block
        # takes copies, so what a checkpointed block recomputes from is still its input
        residuals_out_of_place(self.checkpoint_blocks(), copy_inputs=True)

    def pipeline_layers(self):
        model = self.diffusion_model
        return [LTXAVBegin(self), *(LTXAVBlock(block, model) for block in model.transformer_blocks), LTXAVEnd(self)]

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        model = self.diffusion_model
        # ComfyUI's LTX-2 text encoders mark their output unprocessed (it goes through the model's connectors),
        # but for the old single-file encoder with connectors of its own (its compat mode), whose output is the
        # connectors' already: two contexts side by side, 2 x caption_channels wide. The cache keeps the
        # embedding, not the mark, which the width tells apart
        processed = batch.cond.shape[-1] == 2 * model.caption_channels
        return {**super().extra_cond_inputs(batch, x_noisy), "unprocessed_ltxav_embeds": not processed}

    def model_inputs(self, batch: Batch):
        return super().model_inputs(batch) if batch.audio is None else self.audio_video_inputs(batch)

    def loss(self, batch: Batch, reduce: bool = True, weighted: bool = True) -> torch.Tensor:
        if batch.audio is None:
            return super().loss(batch, reduce, weighted)
        per_sample = self.audio_video_loss_of_output(self.model_output(batch), batch, weighted)
        return per_sample.mean() if reduce else per_sample

    def run_model(self, x_in: torch.Tensor, timestep: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """As ComfyUI's apply_model runs LTX-2: the latent unpacked into its list of streams (video, and audio where
        the batch has it), the timestep made the (video, audio) pair by the model class's process_timestep."""
        return self.run_streams(x_in, timestep, kwargs)


# what LTX-2's _process_output runs on: the last stage's
OUTPUT_PARTS = ("norm_out", "proj_out", "scale_shift_table", "audio_norm_out", "audio_proj_out",
                "audio_scale_shift_table")


class LTXAVBegin(StageInput):
    """Stage input: the batch as run_streams hands it to the model (streams_in: the streams, the timestep pair), then
    the model's own preparation steps (LTXBaseModel._forward up to its blocks: _process_input, _prepare_timestep,
    _prepare_context, ...; no keyframes). Holds every part of the model but its blocks and output. Out: the blocks'
    inputs and what _process_output takes, packed (stages.packed: ComfyUI's timesteps come compressed)."""

    def __init__(self, family):
        super().__init__(family)
        holding_all_but(self, family.diffusion_model, ("transformer_blocks", *OUTPUT_PARTS))

    def forward(self, inputs):
        family, model = self.family, self.family.diffusion_model
        x, timestep, kwargs = family.streams_in(*self.model_inputs(inputs))
        if isinstance(timestep, (tuple, list)) and len(timestep) == 2:  # as LTXAVModel.forward splits the pair
            timestep, kwargs["a_timestep"] = timestep
        else:
            kwargs["a_timestep"] = timestep
        context, mask, frame_rate = kwargs.pop("context"), kwargs.pop("attention_mask", None), kwargs.pop("frame_rate")
        merged = {**family.transformer_options(kwargs), **kwargs}
        batch, dtype = x[0].shape[0], x[0].dtype
        x, coords, extra = model._process_input(x, None, None, **merged)
        merged.update(extra)
        timestep, embedded, merged["prompt_timestep"] = model._prepare_timestep(timestep, batch, dtype, **merged)
        context, mask = model._prepare_context(context, batch, x, mask)
        mask = model._prepare_attention_mask(mask, dtype)
        pe = model._prepare_positional_embeddings(coords, frame_rate, dtype)
        self_mask = model._build_guide_self_attention_mask(x, {}, merged)
        carried = packed((x, context, mask, timestep, pe, self_mask, embedded, merged))
        self.sendable(*floats(carried))
        return carried


class LTXAVBlock(torch.nn.Module):
    """One block, run by ComfyUI's own loop over the blocks (_process_transformer_blocks) given this block alone."""

    def __init__(self, block, model):
        super().__init__()
        self.block = block
        self._blocks_loop = type(model)._process_transformer_blocks

    def forward(self, inputs):
        from types import SimpleNamespace
        x, context, mask, timestep, pe, self_mask, embedded, merged = unpacked(inputs)
        x = self._blocks_loop(SimpleNamespace(transformer_blocks=[self.block]), x, context, mask, timestep, pe,
                              transformer_options={}, self_attention_mask=self_mask, **merged)
        return packed((x, context, mask, timestep, pe, self_mask, embedded, merged))


class LTXAVEnd(torch.nn.Module):
    def __init__(self, family):
        super().__init__()
        model = family.diffusion_model
        for name in OUTPUT_PARTS:
            setattr(self, name, getattr(model, name))
        self._process_output = model._process_output  # a method of the model: its output parts are held here

    def forward(self, inputs):
        x, context, mask, timestep, pe, self_mask, embedded, merged = unpacked(inputs)
        return ends_here(streams_out(self._process_output(x, embedded, None, **merged)), *floats(inputs))
