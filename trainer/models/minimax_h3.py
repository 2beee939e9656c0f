"""MiniMax H3 (ComfyUI 0.33's `MiniMaxH3`): one packed sequence of text, video and audio tokens through DiT blocks,
generating video with sound. ComfyUI always samples both streams (Empty MiniMax H3 Latent AV makes a nested video
and audio latent), so the trainer trains it on clips cached with its audio VAE (Cache Latents' audio_vae), as
ComfyUI samples that latent (audio_video.py), and refuses a dataset without sound.

Its objective is ComfyUI's FLOW_AV: flow matching whose audio stream has a noise schedule of its own (shift 3 beside
the video's 12). ComfyUI's sampler carries the audio latent scaled onto the video's schedule (process_latent_in,
with the latent shapes set on the model), and the model turns the carried latent into the audio stream's own and
its output back into the carried one's velocity: so the training target is the plain flow velocity of the packed,
carried latent, at the video's sigma, which is what the sampler integrates.

ComfyUI's model takes one sample at a time (its forward refuses a batch, its extra_conds refines the first caption
only): training takes batch size 1 (captions of other lengths would be stacked repeated to one length), and a batch
of one caption at several noise levels (an evaluation's) runs sample by sample.

ComfyUI 0.3.64 has no MiniMax H3: there this family matches nothing."""
from __future__ import annotations

import dataclasses

import torch

from .audio_video import AudioVideoStreams
from .base import Batch, ModelFamily, UnsupportedSetting, is_comfy_model
from .residuals import residuals_out_of_place

# the DiT blocks' layers (not the text refiner's, which ComfyUI runs once per sampling, before the steps)
ATTENTION = (r"^blocks\.\d+\.attn\.(qkv_proj|out_proj)$",)
FEED_FORWARD = (r"^blocks\.\d+\.mlp\.(fc1|fc2)$",)


class MiniMaxH3Family(AudioVideoStreams, ModelFamily):
    name = "minimax_h3"
    display_name = "MiniMax H3"
    base_model_version = "minimax_h3"
    latent_ndim = 5
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}
    needs_audio = True  # ComfyUI samples it with sound, always
    reads_timestep_value = True
    latent_channels = 24  # its video VAE's (ComfyUI's MiniMaxH3Video); its latent format is the packed AV one's, 32

    @classmethod
    def matches(cls, base_model) -> bool:
        return is_comfy_model(base_model, "MiniMaxH3")

    def checkpoint_blocks(self) -> list[torch.nn.Module]:
        return list(self.diffusion_model.blocks)

    def prepare_for_training(self) -> None:
        super().prepare_for_training()
        # its blocks add each gated residual into the stream they receive in place (x[a:b].addcmul_), after a norm
        # saved it: each block takes a copy, so what a checkpointed block recomputes from is still its input
        residuals_out_of_place(self.checkpoint_blocks(), copy_inputs=True)

    def check_settings(self, spec) -> None:
        super().check_settings(spec)
        if spec.train.batch_size > 1:  # captions of other lengths would be repeated to one length to stack them
            from ..data.loading import ONE_CAPTION_AT_A_TIME
            raise UnsupportedSetting("train.batch_size: ComfyUI's MiniMax H3 takes one caption a call, its own "
                                     f"length: {ONE_CAPTION_AT_A_TIME}")

    def pipeline_layers(self):
        raise UnsupportedSetting("distributed.pipeline_stages: MiniMax H3's blocks run one packed sequence of text, "
                                 "video and audio and do not split into pipeline stages yet; use 1 stage (ZeRO "
                                 "spreads the model instead)")

    def model_inputs(self, batch: Batch):
        self._one_sample(batch)
        return self.audio_video_inputs(batch)

    def run_model(self, x_in: torch.Tensor, timestep: torch.Tensor, kwargs: dict) -> torch.Tensor:
        return self.run_streams(x_in, timestep, kwargs)

    def model_output(self, batch: Batch) -> torch.Tensor:
        return torch.cat([self.run_model(*self.model_inputs(one)) for one in samples(batch)])

    def loss(self, batch: Batch, reduce: bool = True, weighted: bool = True) -> torch.Tensor:
        per_sample = torch.cat([self.audio_video_loss_of_output(self.run_model(*self.model_inputs(one)), one, weighted)
                                for one in samples(batch)])
        return per_sample.mean() if reduce else per_sample

    def _one_sample(self, batch: Batch) -> None:
        if batch.audio is None:
            raise UnsupportedSetting("dataset: MiniMax H3 generates video with sound, and these clips were cached "
                                     "without it: connect MiniMax H3's audio VAE to Cache Latents' audio_vae")
        if len(batch.latents) > 1:  # model_output and loss split a batch (an evaluation's, one caption at several
            # noise levels); a caller of model_inputs must too
            raise ValueError(f"MiniMax H3 runs one sample at a time, not {len(batch.latents)}")


def samples(batch: Batch) -> list[Batch]:
    """The batch as batches of one sample each (every per-sample tensor sliced; the text extras' too)."""
    from ..data.loading import each_tensor
    return [Batch(**{f.name: each_tensor(getattr(batch, f.name), lambda t, i=i: t[i:i + 1])
                     for f in dataclasses.fields(batch)}) for i in range(len(batch.latents))]
