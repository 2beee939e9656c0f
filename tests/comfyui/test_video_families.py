"""Video families: Wan 2.1 / 2.2 text-to-video and image-to-video (with the 2.2 5B TI2V), HunyuanVideo and
LTX-Video, each from a tiny random-weight model that ComfyUI's own loader (UNETLoader's comfy.sd code) detects as
that family.

Unit tests (no server) prove detection, that each family's loss is the loss of ComfyUI's own sampler call on the
same noisy latent (calc_cond_batch → apply_model, conditioning through encode_model_conds), and that a start image
reaches the model exactly as ComfyUI's WanImageToVideo and Wan22ImageToVideoLatent nodes hand it at inference.
One graph prompt then trains every family 2 steps and loads each LoRA through the stock LoraLoaderModelOnly.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ON_COMFYUI_033
from family_graphs import REFERENCE_FOLDER, VIDEO_MODELS, VIDEO_VAE_CHANNELS, merged, run_events
from family_graphs import bootstrap_comfy, sampling_graph, saved_latent, training_graph
from family_graphs import video_model_files, video_models_in_server  # noqa: F401  (fixtures)
from stage_boundaries import assert_stages_compute_the_models_loss

pytestmark = pytest.mark.comfyui
WAN_VAE = "tiny_wan_vae.safetensors"  # conftest.tiny_models
# the family against ComfyUI's own sampler path: the same computation to rounding. ComfyUI 0.33's path rounds a few
# elements differently (seen: at most 1.7e-6 on 2-5 of 3072-9216 elements; a wrong input moves them by ~1e-1)
SAME = dict(rtol=1e-5, atol=1e-5) if ON_COMFYUI_033 else dict(rtol=1e-6, atol=1e-6)
LOSS_SAME = dict(rtol=1e-6, atol=0)  # a loss (a mean over those elements): ComfyUI's to 1e-6 on both versions
TEXT = {"wan": (8, 4096, None), "hunyuan_video": (8, 4096, 768), "ltxv": (8, 4096, None),
        "ltxav": (8, 32, None)}  # the tiny LTX-2's connectors' width


def load_with_unet_loader(path):
    """What UNETLoader does with the file (weight_dtype default), held in fp32 as an fp32 run holds it."""
    import comfy.sd
    return comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})


def comfy_sampler_output(patcher, x, sigma, conditioning, noise, **encode_kwargs) -> torch.Tensor:
    """The diffusion model's raw output for noisy latent x at sigma, computed as ComfyUI's sampler computes it:
    the node's conditioning converted and encoded through the model's extra_conds (encode_model_conds, as
    process_conds does), then calc_cond_batch → apply_model. Flow models: denoised = x - output * sigma."""
    import comfy.sampler_helpers
    import comfy.samplers
    conds = [comfy.sampler_helpers.convert_cond(conditioning)]
    conds = [comfy.samplers.encode_model_conds(patcher.model.extra_conds, c, noise, x.device, "positive",
                                               **encode_kwargs) for c in conds]
    patcher.pre_run()  # what the sampler's start does (the model's current patcher)
    try:
        denoised = comfy.samplers.calc_cond_batch(patcher.model, conds, x, sigma, {})[0]
    finally:
        patcher.cleanup()
    return (x - denoised) / sigma.view(-1, *[1] * (x.dim() - 1))


def random_batch(channels: int, text_family: str, frames: int = 3, h: int = 4, w: int = 8, batch: int = 2):
    from ingraph_trainer.trainer.models import Batch
    tokens, width, pooled = TEXT[text_family]
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, channels, frames, h, w, generator=g)
    cond = torch.randn(1, tokens, width, generator=g).expand(batch, -1, -1)  # one prompt, as a sampler's batch
    pooled = torch.randn(1, pooled, generator=g).expand(batch, -1) if pooled else None
    return Batch(latents, cond, pooled, torch.randn(latents.shape, generator=g), torch.tensor([0.3, 0.8]))


def noisy(family, batch):
    """The noisy latent the family trains on (ComfyUI's noise scaling at the family's sigma)."""
    x0, noise, sigma = family.noising(batch.latents, batch.noise, batch.timesteps)
    return family.base_model.model_sampling.noise_scaling(sigma.view(-1, 1, 1, 1, 1), noise, x0), x0, noise, sigma


def conditioning_of(batch, **extras) -> list:
    values = {"pooled_output": batch.pooled[:1]} if batch.pooled is not None else {}
    return [[batch.cond[:1], {**values, **extras}]]


def test_comfyui_detects_each_tiny_video_model_and_the_family_loss_is_comfyuis(video_model_files):
    """Each file loads through UNETLoader's code as its family (ComfyUI's own detection picks the supported_models
    class), the trainer picks the family and variant, adapters target linear layers of the blocks it checkpoints,
    and with no reference image the family's loss is the loss of ComfyUI's own sampler output on the same noisy
    5-D latent (three latent frames), to 1e-6."""
    from ingraph_trainer.trainer.models import family_for
    for stem, (_, _, config_class, name, variant, channels, text) in VIDEO_MODELS.items():
        patcher = load_with_unet_loader(video_model_files[stem])
        assert type(patcher.model.model_config).__name__ == config_class, stem
        family = family_for(patcher.model, patcher=patcher)
        assert (family.name, getattr(family, "variant", None)) == (name, variant), stem
        assert family.latent_ndim == 5 and family.prediction == "flow"
        assert family.reference_input == (None if variant in (None, "t2v") else "start_image"), stem
        targets = family.adapter_targets("attention")
        modules = dict(family.diffusion_model.named_modules())
        assert targets and all(isinstance(modules[t], torch.nn.Linear) for t in targets), stem
        assert len(family.adapter_targets("attention_ff")) > len(targets), stem
        in_blocks = {id(m) for block in family.checkpoint_blocks() for m in block.modules()}
        assert all(id(modules[t]) in in_blocks for t in targets), stem
        batch = random_batch(channels, text)
        if name == "ltxv":  # T5's attention mask, cached beside the embedding: 5 tokens, then padding
            batch.text_mask = torch.tensor([[1] * 5 + [0] * (batch.cond.shape[1] - 5)]).expand(len(batch.cond), -1)
        x, x0, noise, sigma = noisy(family, batch)
        with torch.no_grad():
            ours = family.loss(batch, reduce=False)
            # HunyuanVideo trains at train.guidance (1 by default), as FluxGuidance sets it in a graph
            # LTX-Video: the mask as CLIPTextEncode puts T5's into the conditioning
            # LTX-2: its text encoder's mark (the model's connectors take the embedding), and the latent shapes
            # ComfyUI's sampler hands the model with a video latent alone
            extras = {"hunyuan_video": {"guidance": family.guidance},
                      "ltxv": {"attention_mask": batch.text_mask},
                      "ltxav": {"unprocessed_ltxav_embeds": True}}.get(name, {})
            extras = {k: v[:1] if k == "attention_mask" else v for k, v in extras.items()}  # one prompt's
            out = comfy_sampler_output(patcher, x, sigma, conditioning_of(batch, **extras), noise,
                                       **({"latent_shapes": [x.shape]} if name == "ltxav" else {}))
        theirs = (out - family.target(x0, noise, sigma.view(-1, 1, 1, 1, 1))).pow(2).mean(dim=(1, 2, 3, 4))
        torch.testing.assert_close(ours, theirs, **LOSS_SAME, msg=stem)
        # and it trains: ComfyUI's blocks add residuals in place, which the family's preparation makes differentiable
        family.prepare_for_training()
        for t in targets:  # what an adapter trains (ComfyUI 0.33 loads its models frozen)
            modules[t].weight.requires_grad_(True)
        family.loss(batch).backward()
        assert all(modules[t].weight.grad is not None and modules[t].weight.grad.abs().sum() > 0 for t in targets), stem


class FakeVideoVAE:
    """A deterministic stand-in for a causal video VAE's encode (pixels [F, H, W, 3] → [1, C, (F-1)//4 + 1,
    H/s, W/s]): the first frame alone, then groups of four, each latent frame also carrying the first frame (so
    what follows a start image depends on it, as in Wan's VAE) and a per-frame offset (gray is not zero)."""

    def __init__(self, channels: int, scale: int):
        g = torch.Generator().manual_seed(7)
        self.mix, self.carry = torch.randn(channels, 3, generator=g), torch.randn(channels, 3, generator=g)
        self.offset, self.scale = torch.randn(channels, generator=g), scale

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.avg_pool2d(pixels[..., :3].movedim(-1, 1).float() * 2 - 1, self.scale)
        groups = torch.cat([x[:1]] + [x[i:i + 4].mean(0, keepdim=True) for i in range(1, x.shape[0], 4)])
        latent = torch.einsum("cd,tdhw->cthw", self.mix, groups) \
            + torch.einsum("cd,dhw->chw", self.carry, x[0])[:, None]
        frames = torch.arange(groups.shape[0], dtype=torch.float32)
        return (latent + self.offset[:, None, None, None] * (frames[:, None, None] + 1)).unsqueeze(0)


def start_image(height: int, width: int) -> torch.Tensor:
    return torch.rand(1, height, width, 3, generator=torch.Generator().manual_seed(3))


def test_ltx_trains_at_its_clips_frame_rate_as_ltxv_conditioning_gives_it(video_model_files, tmp_path):
    """LTX-Video and LTX-2 place each latent frame in time by the frame rate LTXVConditioning puts into the
    conditioning: the family reads it from the run's dataset (the fps its clips were cached at, in the manifest),
    and its loss is ComfyUI's sampler's with that frame rate, not with the default 25 (which it differs from)."""
    import types

    from ingraph_trainer.cache.store import write_manifest
    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    from ingraph_trainer.trainer.models import family_for
    item = types.SimpleNamespace(path="clip.mp4", caption="a clip", latent="l" * 64, latent_sha="s", text="t" * 64,
                                 text_sha="s", bucket=(64, 32), flip=False, text_variants=[], mask_source=None,
                                 frames=9, references=[])
    clips = types.SimpleNamespace(cache_keys=lambda: [], folder=str(tmp_path), repeats=1, items=[item],
                                  empty_text=None, fps=16.0)
    dataset = load_cached_dataset(str(write_manifest(tmp_path / "dataset.json", clips, tmp_path / "cache")))
    assert dataset.fps == 16.0
    stems = [stem for stem, spec in VIDEO_MODELS.items() if spec[3] in ("ltxv", "ltxav")]
    assert stems, VIDEO_MODELS
    for stem in stems:
        _, _, _, name, _, channels, text = VIDEO_MODELS[stem]
        patcher = load_with_unet_loader(video_model_files[stem])
        family = family_for(patcher.model, patcher=patcher)
        batch = random_batch(channels, text)
        if name == "ltxv":  # T5's attention mask, as the test above gives it
            batch.text_mask = torch.tensor([[1] * 5 + [0] * (batch.cond.shape[1] - 5)]).expand(len(batch.cond), -1)
        x, x0, noise, sigma = noisy(family, batch)
        extras = {"ltxv": {"attention_mask": batch.text_mask[:1] if batch.text_mask is not None else None},
                  "ltxav": {"unprocessed_ltxav_embeds": True}}.get(name, {})
        with torch.no_grad():
            at_25 = family.loss(batch, reduce=False)
            family.read_dataset(dataset)
            ours = family.loss(batch, reduce=False)
            out = comfy_sampler_output(patcher, x, sigma, conditioning_of(batch, frame_rate=16.0, **extras), noise,
                                       **({"latent_shapes": [x.shape]} if name == "ltxav" else {}))
        theirs = (out - family.target(x0, noise, sigma.view(-1, 1, 1, 1, 1))).pow(2).mean(dim=(1, 2, 3, 4))
        torch.testing.assert_close(ours, theirs, **LOSS_SAME, msg=stem)
        assert not torch.equal(ours, at_25), (stem, ours, at_25)  # the frame rate reached the model (same noise)


@pytest.mark.parametrize("stem", ["tiny_wan21_i2v", "tiny_wan22_i2v"])
def test_wan_i2v_takes_the_start_image_as_wan_image_to_video_hands_it(video_model_files, stem):
    """Wan 2.1 i2v and the Wan 2.2 14B i2v layout: a batch whose reference is the start image as WanImageToVideo
    encodes it (the image, then gray frames to the clip's length) gives the model exactly the inputs ComfyUI's
    sampler gives it with that node's conditioning (concat_latent_image + concat_mask through
    model_base.WAN21.concat_cond): same output and loss to 1e-6. A reference of another length is refused."""
    bootstrap_comfy()  # ComfyUI's folder ahead of the repo's: comfy_extras import ComfyUI's `nodes`
    from comfy_extras.nodes_wan import WanImageToVideo

    from ingraph_trainer.trainer.models import family_for
    patcher = load_with_unet_loader(video_model_files[stem])
    family = family_for(patcher.model, patcher=patcher)
    vae, length, height, width = FakeVideoVAE(16, 8), 9, 32, 64
    image = start_image(height, width)
    batch = random_batch(16, "wan", frames=3, h=height // 8, w=width // 8)
    positive = conditioning_of(batch)
    positive, _, _ = WanImageToVideo.execute(positive, positive, vae, width, height, length, 1,
                                             start_image=image).args
    # what the data side caches for the item: the start image followed by gray, at the clip's length
    video = torch.cat([image, torch.full((length - 1, height, width, 3), 0.5)])
    start = vae.encode(video).expand(2, -1, -1, -1, -1)
    batch.references = [start]
    x, x0, noise, sigma = noisy(family, batch)
    with torch.no_grad():
        x_in, timestep, kwargs = family.model_inputs(batch)
        ours = family.diffusion_model(x_in, timestep, transformer_options={}, **kwargs)
        theirs = comfy_sampler_output(patcher, x, sigma, positive, noise)
        loss = family.loss(batch, reduce=False)
        without = family.loss(type(batch)(**{**batch.__dict__, "references": None}), reduce=False)
    torch.testing.assert_close(ours, theirs, **SAME)
    expected = (theirs - family.target(x0, noise, sigma.view(-1, 1, 1, 1, 1))).pow(2).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(loss, expected, **LOSS_SAME)
    assert (loss - without).abs().max() > 1e-4, "the start image did not reach the model"
    batch.references = [batch.references[0][:, :, :1]]
    with pytest.raises(ValueError, match=r"Batch\.references: .*WanImageToVideo.*3 latent frames"):
        family.loss(batch)
    batch.references = [start, start]
    with pytest.raises(ValueError, match=r"Batch\.references: .*one start image per item"):
        family.loss(batch)


def test_wan22_ti2v_takes_the_start_image_as_the_latents_first_frame(video_model_files):
    """The Wan 2.2 5B TI2V: a batch with a start image trains the model on exactly what ComfyUI's sampler gives it
    for Wan22ImageToVideoLatent's latent and noise mask (the first frame the clean start image, put back over the
    noise, its timestep 0 through WAN22.process_timestep): same output to 1e-6, and the loss is ComfyUI's output's
    loss on the generated frames only (the sampler keeps the start image there whatever the model predicts)."""
    bootstrap_comfy()  # ComfyUI's folder ahead of the repo's: comfy_extras import ComfyUI's `nodes`
    import comfy.sampler_helpers
    from comfy_extras.nodes_wan import Wan22ImageToVideoLatent

    from ingraph_trainer.trainer.models import family_for
    patcher = load_with_unet_loader(video_model_files["tiny_wan22_ti2v"])
    family = family_for(patcher.model, patcher=patcher)
    vae, length, height, width = FakeVideoVAE(48, 16), 9, 64, 128
    image = start_image(height, width)
    batch = random_batch(48, "wan", frames=3, h=height // 16, w=width // 16)
    batch.references = [vae.encode(image).expand(2, -1, -1, -1, -1)]  # the start image alone, as the node encodes it
    latent = Wan22ImageToVideoLatent.execute(vae, width, height, length, 2, start_image=image).args[0]
    # the sampler's latent_image: the node's first frame, the clip's latents after it (what training noises)
    node_mask = latent["noise_mask"]
    latent_image = patcher.model.process_latent_in(latent["samples"] * (1 - node_mask) + batch.latents * node_mask)
    _, noise, sigma = family.noising(batch.latents, batch.noise, batch.timesteps)
    mask = comfy.sampler_helpers.prepare_mask(node_mask, noise.shape, "cpu")
    x = patcher.model.model_sampling.noise_scaling(sigma.view(-1, 1, 1, 1, 1), noise, latent_image)
    x = x * mask + latent_image * (1 - mask)  # KSamplerX0Inpaint with WAN22.scale_latent_inpaint
    with torch.no_grad():
        x_in, timestep, kwargs = family.model_inputs(batch)
        ours = family.diffusion_model(x_in, timestep, transformer_options={}, **kwargs)
        theirs = comfy_sampler_output(patcher, x, sigma, conditioning_of(batch), noise, latent_image=latent_image,
                                      denoise_mask=mask)
        loss = family.loss(batch, reduce=False)
        plain = family.loss(type(batch)(**{**batch.__dict__, "references": None}), reduce=False)
    torch.testing.assert_close(x_in, x)
    assert timestep.shape == (2, 3) and (timestep[:, 0] == 0).all() and (timestep[:, 1:] > 0).all()
    torch.testing.assert_close(ours, theirs, **SAME)
    target = family.target(latent_image, noise, sigma.view(-1, 1, 1, 1, 1))
    expected = (theirs - target)[:, :, 1:].pow(2).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(loss, expected, **LOSS_SAME)
    assert (loss - plain).abs().max() > 1e-4, "the start image did not reach the model"


def test_pipeline_layers_compute_what_the_model_computes_and_i2v_refuses_them(video_model_files):
    """HunyuanVideo's and LTX-Video's pipeline layers (and Wan text-to-video's), run in sequence on a 3-frame
    non-square latent with a stage boundary after every layer (stage_boundaries), give the family's own loss (to
    1e-6) (HunyuanVideo also with no single blocks, the streams joined by the last layer). Wan image-to-video variants refuse pipeline stages naming the setting: stage inputs
    carry no start image."""
    from ingraph_trainer.trainer.models import UnsupportedSetting, family_for
    from ingraph_trainer.trainer.models.hunyuan_video import HunyuanVideoFamily
    import comfy.sd
    no_single = comfy.sd.load_diffusion_model_state_dict(
        HunyuanVideoFamily.scratch_state_dict(0, depth=2, depth_single_blocks=0), {"dtype": torch.float32})
    cases = [(load_with_unet_loader(video_model_files[stem]), VIDEO_MODELS[stem]) for stem in
             ("tiny_wan21_t2v", "tiny_hunyuan_video", "tiny_ltxv")]
    for patcher, (*_, channels, text) in cases + [(no_single, VIDEO_MODELS["tiny_hunyuan_video"])]:
        family = family_for(patcher.model, patcher=patcher)
        family.prepare_for_training()
        assert_stages_compute_the_models_loss(family, random_batch(channels, text, frames=3, h=6, w=10))
    for stem in ("tiny_wan21_i2v", "tiny_wan22_i2v", "tiny_wan22_ti2v"):
        patcher = load_with_unet_loader(video_model_files[stem])
        with pytest.raises(UnsupportedSetting, match="distributed.pipeline_stages: Wan 2.* start image"):
            family_for(patcher.model, patcher=patcher).pipeline_layers()


@pytest.mark.skipif(not ON_COMFYUI_033, reason="skipped: this ComfyUI has no LTX-2 (0.33 and later have)")
def test_ltx2_trains_its_video_stream_and_checkpointed_blocks_give_the_same_gradients(video_model_files):
    """LTX-2 on a video latent alone: the presets adapt the video stream's layers only (no audio layer, which a
    batch with no audio latents gives no gradient), and its blocks, which add into the (video, audio) pair they
    receive in place, give the same LoRA gradients checkpointed as not (a block that changed its own input would
    recompute from the changed one). Split into pipeline stages (stage_boundaries), the same loss (to 1e-6): the
    first stage runs the model's own preparation steps, and what its blocks take (compressed timesteps, the empty
    audio stream, nested lists) crosses the stages packed."""
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.parallel.memory import memory_savers
    from ingraph_trainer.trainer.models import family_for
    patcher = load_with_unet_loader(video_model_files["tiny_ltxav"])
    family = family_for(patcher.model, patcher=patcher)
    family.prepare_for_training()
    assert_stages_compute_the_models_loss(family, random_batch(128, "ltxav"))
    grads = []
    for checkpointing in (False, True):
        patcher = load_with_unet_loader(video_model_files["tiny_ltxav"])
        family = family_for(patcher.model, patcher=patcher)
        family.prepare_for_training()
        targets = family.adapter_targets("attention_ff")
        assert targets and not any("audio" in t or "a2v" in t or "v2a" in t for t in targets), targets
        params = inject_adapter(family.diffusion_model, targets, "lora", 2, 2.0, 0.0)
        torch.manual_seed(3)
        for param in params:  # both halves of each LoRA non-zero: every one takes a gradient
            param.data.normal_(0, 0.1)
        memory_savers(family, checkpointing, 0)
        family.loss(random_batch(128, "ltxav")).backward()
        grads.append([param.grad for param in params])
    assert len(grads[0]) == len(grads[1]) and all(g.abs().sum() > 0 for g in grads[0])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)
    # distillation's networks call the model as training does (a one-stream list, the timestep pair)
    from ingraph_trainer.trainer.tasks.distill_networks import Denoiser
    batch = random_batch(128, "ltxav")
    with torch.no_grad():
        x0 = Denoiser(family)("x0", batch.noise, torch.tensor([0.7, 0.3]), batch.cond)
    assert x0.shape == batch.noise.shape and torch.isfinite(x0).all()


def audio_video_batch(frames: int = 3, audio_frames: int = 5):
    """random_batch for LTX-2 with its clips' audio latents (LTX-2's audio VAE: 8 channels, 16 frequency bins)."""
    batch = random_batch(128, "ltxav", frames=frames)
    g = torch.Generator().manual_seed(2)
    batch.audio = torch.randn(len(batch.latents), 8, audio_frames, 16, generator=g)
    batch.audio_noise = torch.randn(batch.audio.shape, generator=g)
    return batch


@pytest.mark.skipif(not ON_COMFYUI_033, reason="skipped: this ComfyUI has no LTX-2 (0.33 and later have)")
def test_ltx2_trains_both_streams_on_audio_latents_and_its_loss_is_comfyuis(video_model_files):
    """LTX-2 on clips with their audio latents: the loss is the video stream's plus the audio stream's, each of
    ComfyUI's own sampler output on the packed audio-video latent (the nested latent LTXVConcatAVLatent makes,
    packed as its sampler packs it, the latent shapes handed to extra_conds), to 1e-6; the presets then add the
    audio stream's layers and the cross-attention between the streams, and every one takes a gradient."""
    import comfy.utils
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.data.loading import CachedDataset
    from ingraph_trainer.trainer.models import family_for
    patcher = load_with_unet_loader(video_model_files["tiny_ltxav"])
    family = family_for(patcher.model, patcher=patcher)
    video_only = family.adapter_targets("attention_ff")
    dataset = CachedDataset("", [], [], [], [], [], [], [], audio=True)
    family.read_dataset(dataset)
    targets = family.adapter_targets("attention_ff")
    added = sorted(set(targets) - set(video_only))
    assert set(video_only) < set(targets) and all(
        any(k in t for k in ("audio_attn1", "audio_attn2", "audio_ff", "audio_to_video", "video_to_audio"))
        for t in added), added
    assert any("audio_ff" in t for t in added) and any("video_to_audio_attn" in t for t in added)
    batch = audio_video_batch()
    with torch.no_grad():
        ours = family.loss(batch, reduce=False)
        x0, _ = comfy.utils.pack_latents([batch.latents, batch.audio])
        noise, shapes = comfy.utils.pack_latents([batch.noise, batch.audio_noise])
        sigma = family.sigmas(batch.timesteps)
        x = family.base_model.model_sampling.noise_scaling(sigma.view(-1, 1, 1), noise, x0)
        out = comfy_sampler_output(patcher, x, sigma, conditioning_of(batch, unprocessed_ltxav_embeds=True), noise,
                                   latent_shapes=shapes)
    assert out.shape == x.shape and len(shapes) == 2
    streams = zip(comfy.utils.unpack_latents(out, shapes), comfy.utils.unpack_latents(noise - x0, shapes), strict=True)
    theirs = sum((o - t).pow(2).mean(dim=tuple(range(1, o.dim()))) for o, t in streams)
    torch.testing.assert_close(ours, theirs, **LOSS_SAME)
    # the audio counts: the same batch with other audio latents has another loss
    other = audio_video_batch()
    other.audio = other.audio.flip(2)
    with torch.no_grad():
        assert not torch.allclose(family.loss(other, reduce=False), ours)
    family.prepare_for_training()
    params = inject_adapter(family.diffusion_model, targets, "lora", 2, 2.0, 0.0)
    torch.manual_seed(3)
    for param in params:
        param.data.normal_(0, 0.1)
    family.loss(batch).backward()
    assert params and all(param.grad is not None and param.grad.abs().sum() > 0 for param in params)


def video_sampling_graph(stem: str, lora_name: str | None, prefix: str) -> dict:
    return sampling_graph(stem, lora_name, prefix, unet_name=f"{stem}.safetensors", text_family=VIDEO_MODELS[stem][6])


# Wan text-to-video trains through the graph in tests/comfyui/test_model_families.py (and on clips in test_video_data.py)
GRAPH_MODELS = [stem for stem in VIDEO_MODELS if stem != "tiny_wan21_t2v"]


@pytest.mark.skipif(not ON_COMFYUI_033, reason="skipped: every video family through the graph runs on ComfyUI 0.33, "
                    "whose TAEHV is a video VAE small enough for each one's latents (0.3.64's are hundreds of "
                    "millions of parameters); what is each family's own runs on both (test_comfyui_detects_each_tiny_"
                    "video_model_and_the_family_loss_is_comfyuis, the Wan and HunyuanVideo image-to-video graph tests)")
def test_every_video_family_trains_in_one_graph_and_loads_in_lora_loader(video_models_in_server, client):
    """One prompt trains each tiny video model 2 steps (fp32) through the graph: the Wan image-to-video models on
    images with a start image beside each (name.ref.png, handed to the model as WanImageToVideo does), the others
    on the plain images. Each LoRA has ComfyUI keys, loads through the stock LoraLoaderModelOnly with no "lora key
    not loaded", and changes what KSampler makes."""
    from safetensors.torch import load_file

    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    comfy = video_models_in_server
    graphs = {}
    for stem in GRAPH_MODELS:
        _, _, _, name, variant, channels, text = VIDEO_MODELS[stem]
        model = {"class_type": "UNETLoader", "inputs": {"unet_name": f"{stem}.safetensors", "weight_dtype": "default"}}
        graph = training_graph("wan", f"video_{stem}", model=model, text_family=text)
        graph["2"]["inputs"]["vae_name"] = VIDEO_VAE_CHANNELS[channels]
        if variant not in (None, "t2v"):
            graph["4"]["inputs"]["folder"] = REFERENCE_FOLDER
        graphs[stem] = graph
    outcome = client.run(merged(graphs), timeout=1200)
    assert outcome.ok, outcome.error
    events = run_events(outcome)
    started = [e for e in events if e["type"] == "started"]
    assert sorted(e["family"] for e in started) == sorted(VIDEO_MODELS[stem][3] for stem in GRAPH_MODELS)
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == 2 * len(GRAPH_MODELS) and all(torch.isfinite(torch.tensor(e["loss"])) for e in steps)
    slots = {e["run_dir"].rsplit("-video_", 1)[1].rsplit("-", 1)[0]:
             load_cached_dataset(str(Path(e["run_dir"]) / "dataset.json")).reference_slots for e in started}
    assert slots == {stem: 0 if VIDEO_MODELS[stem][4] is None else 1 for stem in GRAPH_MODELS}, slots
    for stem in GRAPH_MODELS:
        adapter = load_file(str(comfy.base_dir / "models" / "loras" / f"video_{stem}.safetensors"))
        assert adapter and all(k.startswith("diffusion_model.") for k in adapter), (stem, sorted(adapter)[:3])

    log_before = len(comfy.log_text())
    samples = {}
    for stem in GRAPH_MODELS:
        samples[f"{stem}.base"] = video_sampling_graph(stem, None, f"{stem}_base")
        samples[f"{stem}.lora"] = video_sampling_graph(stem, f"video_{stem}.safetensors", f"{stem}_lora")
    outcome = client.run(merged(samples), timeout=600)
    assert outcome.ok, outcome.error
    log = comfy.log_text()[log_before:]
    assert "lora key not loaded" not in log and "ERROR" not in log, log[-3000:]
    for stem in GRAPH_MODELS:
        base, trained = saved_latent(comfy, f"{stem}_base"), saved_latent(comfy, f"{stem}_lora")
        assert base.shape == trained.shape and (base - trained).abs().max() > 1e-6, f"{stem}: the LoRA changed nothing"


def talking_and_waving(folder: Path, frames: int, fps: int) -> None:
    """Two captioned clips with sound: a stereo ramp that says when it is in lossless PCM (.mkv), a sine in AAC
    (.mp4)."""
    from media_files import time_ramp, write_video
    write_video(folder / "talk.mkv", frames, fps=fps, sound=time_ramp)
    write_video(folder / "wave.mp4", frames, fps=fps, sound=lambda t: np.sin(2 * np.pi * 440 * t)[None] * 0.5,
                audio_codec="aac")
    for clip in ("talk", "wave"):
        (folder / f"{clip}.txt").write_text(f"a {clip}, ingraph style")


def trains_two_steps(client, graph: dict, family: str) -> dict:
    """The graph's run started as `family` and made 2 finite steps; its started event."""
    outcome = client.run(graph, timeout=600)
    assert outcome.ok, outcome.error
    events = run_events(outcome)
    started = next(e for e in events if e["type"] == "started")
    steps = [e for e in events if e["type"] == "step"]
    assert started["family"] == family and len(steps) == 2 and all(np.isfinite(e["loss"]) for e in steps)
    return started


def audio_without_and_with_the_lora(comfy, client, av_sampling, name: str) -> tuple:
    """The audio latents ComfyUI's own audio-video graph `av_sampling(lora, prefix)` makes without the LoRA `name`
    and with it, in one prompt; ComfyUI logged no unmatched key and no error."""
    log_before = len(comfy.log_text())
    outcome = client.run(merged({"base": av_sampling(None, f"{name}_base"),
                                 "lora": av_sampling(f"{name}.safetensors", f"{name}_lora")}), timeout=600)
    assert outcome.ok, outcome.error
    log = comfy.log_text()[log_before:]
    assert "lora key not loaded" not in log and "ERROR" not in log, log[-3000:]
    return saved_latent(comfy, f"{name}_base"), saved_latent(comfy, f"{name}_lora")


@pytest.mark.skipif(not ON_COMFYUI_033, reason="skipped: this ComfyUI has no LTX-2 (0.33 and later have)")
def test_ltx2_trains_its_audio_stream_on_clips_with_sound_through_the_graph(video_models_in_server, client):
    """Two clips with sound (lossless PCM in .mkv, AAC in .mp4), cached through Cache Latents with an audio VAE
    (a stand-in for LTX-2's: ComfyUI's needs torchaudio, which has no wheel here), train the tiny LTX-2 2 steps on
    video and audio. The LoRA holds the audio stream's layers and the cross-attention between the streams beside the
    video's, loads through the stock LoraLoaderModelOnly with no "lora key not loaded", and changes the audio that
    ComfyUI's own audio-video graph (EmptyLTXVLatentVideo + LTXVEmptyLatentAudio → LTXVConcatAVLatent → KSampler →
    LTXVSeparateAVLatent) makes."""
    from safetensors.torch import load_file

    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    comfy, stem = video_models_in_server, "tiny_ltxav"
    folder = comfy.dir("input", "ingraph_ltx2_sound")
    talking_and_waving(folder, frames=16, fps=8)
    model = {"class_type": "UNETLoader", "inputs": {"unet_name": f"{stem}.safetensors", "weight_dtype": "default"}}
    graph = training_graph("wan", "ltx2_sound", model=model, text_family="ltxav")
    graph["2"]["inputs"]["vae_name"] = VIDEO_VAE_CHANNELS[128]
    graph["4"]["inputs"].update(folder="ingraph_ltx2_sound", frame_buckets="1", fps=8.0)
    graph["20"] = {"class_type": "InGraphTestStandInAudioVAE", "inputs": {}}
    graph["5"]["inputs"]["audio_vae"] = ["20", 0]
    graph["7"]["inputs"]["targets"] = "attention + feed-forward"
    started = trains_two_steps(client, graph, "ltxav")
    dataset = load_cached_dataset(str(Path(started["run_dir"]) / "dataset.json"))
    assert dataset.audio and dataset.audio_latents([0, 1]).shape == (2, 8, 3, 16)  # 1 frame at 8 fps: 0.125 s
    adapter = load_file(str(comfy.base_dir / "models" / "loras" / "ltx2_sound.safetensors"))
    layers = {k.split(".lora_")[0] for k in adapter if ".lora_" in k}
    for part in (".attn1.", ".ff.", ".audio_attn1.", ".audio_attn2.", ".audio_ff.", ".audio_to_video_attn.",
                 ".video_to_audio_attn."):
        assert any(part in layer for layer in layers), (part, sorted(layers)[:8])
    # the audio layers trained: their LoRA's up half starts at zero, and only an audio loss moves it
    ups = {k: v for k, v in adapter.items() if k.endswith("lora_up.weight") and ".audio_" in k}
    assert ups and all(v.abs().sum() > 0 for v in ups.values()), sorted(ups)[:4]

    def av_sampling(lora: str | None, prefix: str) -> dict:
        graph = sampling_graph("wan", lora, prefix, unet_name=f"{stem}.safetensors", text_family="ltxav")
        graph.update({
            "12": {"class_type": "EmptyLTXVLatentVideo", "inputs": {"width": 64, "height": 64, "length": 9,
                                                                    "batch_size": 1}},
            "20": {"class_type": "InGraphTestStandInAudioVAE", "inputs": {}},
            "15": {"class_type": "LTXVEmptyLatentAudio", "inputs": {"frames_number": 9, "frame_rate": 8.0,
                                                                    "batch_size": 1, "audio_vae": ["20", 0]}},
            "16": {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": ["12", 0], "audio_latent": ["15", 0]}},
            "17": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["13", 0]}}})
        graph["13"]["inputs"]["latent_image"] = ["16", 0]
        graph["14"]["inputs"]["samples"] = ["17", 1]  # the audio stream's latent
        return graph
    base, trained = audio_without_and_with_the_lora(comfy, client, av_sampling, "ltx2_sound")
    assert base.shape == trained.shape == (1, 8, 28, 16)  # 9 frames at 8 fps: 1.125 s, 25 latents a second
    assert (base - trained).abs().max() > 1e-6, "the LoRA did not change the audio"


@pytest.mark.tiny_models(wan_vae=WAN_VAE)
def test_wan_i2v_trains_on_a_clip_with_its_start_image_and_works_in_the_stock_i2v_graph(video_models_in_server,
                                                                                        client, tools):
    """A 17-frame clip with a start image beside it (walk.ref.png), cached with ComfyUI's own Wan VAE: the clip as a
    5-latent-frame video latent, the start image as WanImageToVideo encodes it (5 latent frames too). The Wan 2.2
    i2v model trains 2 steps on them, and the stock image-to-video graph (LoadImage → WanImageToVideo → KSampler)
    with the LoRA through LoraLoaderModelOnly makes another video than without it."""
    import shutil

    from conftest import tiny_models
    from media_files import SIDE, write_image, write_video

    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    comfy, stem = video_models_in_server, "tiny_wan22_i2v"
    tiny_models(tools, comfy, wan_vae=WAN_VAE)  # once a session, whichever module needs it first
    folder = comfy.dir("input", "ingraph_video_start")
    write_video(folder / "walk.mp4", 17, fps=8)
    (folder / "walk.txt").write_text("a walk, ingraph style")
    write_image(folder / "walk.ref.png", level=200)
    shutil.copy(folder / "walk.ref.png", comfy.dir("input") / "ingraph_walk_start.png")  # where LoadImage lists it

    model = {"class_type": "UNETLoader", "inputs": {"unet_name": f"{stem}.safetensors", "weight_dtype": "default"}}
    graph = training_graph("wan", "video_clip_i2v", model=model, batch_size=1)
    graph["2"]["inputs"]["vae_name"] = "tiny_wan_vae.safetensors"
    graph["4"]["inputs"].update(folder="ingraph_video_start", resolution=SIDE, frame_buckets="17", fps=8.0)
    outcome = client.run(graph, timeout=900)
    assert outcome.ok, outcome.error
    events = run_events(outcome)
    started = next(e for e in events if e["type"] == "started")
    steps = [e for e in events if e["type"] == "step"]
    assert started["family"] == "wan" and len(steps) == 2
    assert all(tuple(e["buckets"][0]) == (SIDE, SIDE, 17) and torch.isfinite(torch.tensor(e["loss"])) for e in steps)
    dataset = load_cached_dataset(str(Path(started["run_dir"]) / "dataset.json"))
    assert tuple(dataset.latent(0).shape) == (16, 5, SIDE // 8, SIDE // 8)
    (start,) = dataset.references([0])
    assert tuple(start.shape) == (1, 16, 5, SIDE // 8, SIDE // 8)

    def sampled(model_input: list, name: str) -> dict:
        return {f"{name}.13": {"class_type": "KSampler", "inputs": {
                    "model": model_input, "positive": ["12", 0], "negative": ["12", 1], "latent_image": ["12", 2],
                    "seed": 1, "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
                f"{name}.14": {"class_type": "SaveLatent", "inputs": {"samples": [f"{name}.13", 0],
                                                                      "filename_prefix": f"latents/{name}"}}}

    # one stock i2v graph, its start image encoded once, sampled without and with the LoRA
    i2v_graph = {
        "1": model,
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_wan_vae.safetensors"}},
        "3": {"class_type": "InGraphTestSyntheticTextEncoder", "inputs": {"family": "wan"}},
        "4": {"class_type": "LoadImage", "inputs": {"image": "ingraph_walk_start.png"}},
        "9": {"class_type": "LoraLoaderModelOnly",
              "inputs": {"model": ["1", 0], "lora_name": "video_clip_i2v.safetensors", "strength_model": 1.0}},
        "10": {"class_type": "CLIPTextEncode", "inputs": {"text": "a walk, ingraph style", "clip": ["3", 0]}},
        "11": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["3", 0]}},
        "12": {"class_type": "WanImageToVideo",
               "inputs": {"positive": ["10", 0], "negative": ["11", 0], "vae": ["2", 0], "width": SIDE, "height": SIDE,
                          "length": 17, "batch_size": 1, "start_image": ["4", 0]}},
        **sampled(["1", 0], "clip_i2v_base"), **sampled(["9", 0], "clip_i2v_lora"),
    }
    log_before = len(comfy.log_text())
    outcome = client.run(i2v_graph, timeout=600)
    assert outcome.ok, outcome.error
    assert "lora key not loaded" not in comfy.log_text()[log_before:]
    base, trained = saved_latent(comfy, "clip_i2v_base"), saved_latent(comfy, "clip_i2v_lora")
    assert base.shape == trained.shape == (1, 16, 5, SIDE // 8, SIDE // 8)
    assert (base - trained).abs().max() > 1e-6, "the LoRA did not change the i2v output"


@pytest.mark.parametrize("config_class, variant", [("HunyuanVideoI2V", dict(in_channels=33)),
                                                   ("HunyuanVideoSkyreelsI2V", dict(in_channels=32,
                                                                                    guidance_embed=False))])
def test_hunyuan_video_i2v_trains_as_comfyui_samples_it_without_a_start_image(config_class, variant):
    """Issue 34: HunyuanVideo's image-to-video weights (their input concatenates a start image's latent, and a mask)
    are the HunyuanVideo family's, trained without a start image: the loss is that of ComfyUI's sampler given an
    empty latent (its latent_image, which concat_cond falls back on), and the adapters take gradients. Before, the
    generic family gave no latent_image and ComfyUI's concat_cond failed on None."""
    bootstrap_comfy()
    import comfy.sd
    from ingraph_trainer.trainer.models import family_for
    from ingraph_trainer.trainer.models.hunyuan_video import HunyuanVideoFamily
    state = HunyuanVideoFamily.scratch_state_dict(seed=0, **variant)
    patcher = comfy.sd.load_diffusion_model_state_dict(state, model_options={"dtype": torch.float32})
    assert type(patcher.model).__name__ == config_class
    family = family_for(patcher.model, patcher=patcher)
    assert family.name == "hunyuan_video" and family.latent_ndim == 5
    batch = random_batch(16, "hunyuan_video")
    x, x0, noise, sigma = noisy(family, batch)
    with torch.no_grad():
        ours = family.loss(batch, reduce=False)
        empty_latent = patcher.model.process_latent_in(torch.zeros_like(x))  # what the sampler passes (samplers.py)
        out = comfy_sampler_output(patcher, x, sigma, conditioning_of(batch, guidance=family.guidance), noise,
                                   latent_image=empty_latent)
    theirs = (out - family.target(x0, noise, sigma.view(-1, 1, 1, 1, 1))).pow(2).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(ours, theirs, **LOSS_SAME)
    family.prepare_for_training()
    targets = family.adapter_targets("attention")
    modules = dict(family.diffusion_model.named_modules())
    for t in targets:
        modules[t].weight.requires_grad_(True)
    family.loss(batch).backward()
    assert targets and all(modules[t].weight.grad is not None and modules[t].weight.grad.abs().sum() > 0
                           for t in targets)


def test_the_generic_family_lays_an_image_dataset_out_as_one_frame_videos_for_a_video_model():
    """A video class the generic family trains (its latent format has a frame axis) takes B C T H W: a B C H W
    batch becomes one-frame videos, as the video families lay it out (a dataset's come from the model's video VAE,
    an image already one frame: dataset_checks refuses an image VAE's); an image class keeps them."""
    from types import SimpleNamespace
    bootstrap_comfy()
    import comfy.latent_formats
    from ingraph_trainer.trainer.models.generic import GenericFamily

    def family(latent_format):
        config = type("SomeClass", (), {})()
        return GenericFamily(SimpleNamespace(diffusion_model=torch.nn.Linear(1, 1), model_config=config,
                                             latent_format=latent_format()), "flow")
    images = torch.zeros(2, 16, 4, 8)
    assert family(comfy.latent_formats.Wan21).to_model_layout(images).shape == (2, 16, 1, 4, 8)
    assert family(comfy.latent_formats.SD3).to_model_layout(images).shape == (2, 16, 4, 8)


# ComfyUI 0.33 classes on objectives of their own: (the trainer's objective, latent shape, text width, the end of
# the names of the layers its presets select)
OWN_OBJECTIVES = {
    # CogVideoX: ComfyUI's V_PREDICTION_DDPM (v-prediction on the unscaled noisy latent); its blocks hold their layers
    "CogVideoX_T2V": ("v_prediction_ddpm", (16, 2, 8, 8), 4096, ["attn_out", "ff_out", "ff_proj", "k", "q", "v"]),
    "CogVideoX_I2V": ("v_prediction_ddpm", (16, 2, 8, 8), 4096, ["attn_out", "ff_out", "ff_proj", "k", "q", "v"]),
    # Cosmos Predict2: ComfyUI's COSMOS_RFLOW, rectified flow with each flow time t named by its EDM sigma t / (1 - t)
    "CosmosT2IPredict2": ("flow", (16, 1, 8, 8), 1024, ["k_proj", "layer1", "layer2", "output_proj", "q_proj",
                                                        "v_proj"]),
}


@pytest.mark.parametrize("class_name", sorted(OWN_OBJECTIVES))
def test_a_model_on_an_objective_of_its_own_trains_on_the_target_comfyui_turns_into_the_clean_latent(class_name):
    """CogVideoX's and Cosmos Predict2's objectives (the generic family): at every noise level the family's target
    is the output ComfyUI's own calculate_denoised turns back into the clean latent from the input its sampler
    gives the model, and the model is called at ComfyUI's timestep for that noise level (Cosmos: the flow time t of
    its EDM sigma, at most its schedule's top); the presets find the blocks' layers, and each gets a gradient."""
    bootstrap_comfy()
    import comfy.supported_models
    from ingraph_trainer.trainer.models import Batch, family_for
    from tools.family_coverage import CLASS_BUILT, class_state_dict, load_model
    if not hasattr(comfy.supported_models, class_name):
        pytest.skip(f"skipped: this ComfyUI has no {class_name} (0.33 and later have)")
    if class_name.startswith("Cosmos") and not ON_COMFYUI_033:
        pytest.skip("skipped: ComfyUI 0.3.64 fixes Cosmos Predict2's depth (28 or 36 blocks), so no tiny one loads "
                    "whole; the ComfyUI 0.33 tier runs this test")
    objective, latent, text_width, layers = OWN_OBJECTIVES[class_name]
    torch.manual_seed(0)
    patcher = load_model(class_state_dict(class_name, *CLASS_BUILT[class_name]), None)
    family = family_for(patcher.model, patcher=patcher)
    assert (family.name, family.prediction) == ("generic", objective)
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(5, *latent, generator=g), torch.randn(5, *latent, generator=g)
    places = torch.tensor([0.02, 0.3, 0.5, 0.7, 0.999])
    x0, noise, sigma = family.noising(latents, noise, places)
    sampling, shape = patcher.model.model_sampling, (-1,) + (1,) * len(latent)
    assert float(sigma.max()) <= float(sampling.sigma_max) * (1 + 1e-6)
    x_noisy = sampling.noise_scaling(sigma.view(shape), noise, x0)  # the sampler's latent; the model sees its input
    target = family.target(x0, noise, sigma.view(shape))
    torch.testing.assert_close(sampling.calculate_denoised(sigma, target, x_noisy), x0, rtol=1e-5, atol=1e-5)
    if family.flow_by_edm_sigma:
        torch.testing.assert_close(sampling.timestep(sigma)[:4], places[:4], rtol=1e-5, atol=1e-6)
    targets = family.adapter_targets("attention_ff")
    assert sorted({t.rsplit(".", 1)[1] for t in targets}) == layers, targets
    family.prepare_for_training()
    modules = dict(family.diffusion_model.named_modules())
    for t in targets:
        modules[t].weight.requires_grad_(True)
    text = torch.randn(2, 8, text_width, generator=g)
    family.loss(Batch(latents[:2], text, None, noise[:2], torch.tensor([0.3, 0.8]))).backward()
    assert all(modules[t].weight.grad.abs().sum() > 0 for t in targets), targets


@pytest.fixture(scope="module")
def minimax_h3_file(tmp_path_factory):
    """The tiny MiniMax H3 (tools/family_coverage.py's MINIMAX_H3_TINY, built by ComfyUI's own get_model), as a file."""
    bootstrap_comfy()
    from safetensors.torch import save_file

    from tools.family_coverage import CLASS_BUILT, class_state_dict
    path = tmp_path_factory.mktemp("minimax_h3") / "tiny_minimax_h3.safetensors"
    save_file(class_state_dict("MiniMaxH3", *CLASS_BUILT["MiniMaxH3"]), str(path))
    return path


def minimax_h3_batch(captions: int = 2):
    """Two samples of MiniMax H3's shapes: 24-channel video latents of 2 latent frames, each caption its own, and
    audio latents [32, stereo, 7] (its audio VAE's)."""
    from ingraph_trainer.trainer.models import Batch
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 24, 2, 4, 6, generator=g)
    cond = torch.randn(2, 5, 32, generator=g)
    if captions == 1:
        cond[1] = cond[0]
    batch = Batch(latents, cond, None, torch.randn(latents.shape, generator=g), torch.tensor([0.3, 0.8]))
    batch.audio = torch.randn(2, 32, 2, 7, generator=g)
    batch.audio_noise = torch.randn(batch.audio.shape, generator=g)
    return batch


@pytest.mark.skipif(not ON_COMFYUI_033, reason="skipped: this ComfyUI has no MiniMax H3 (0.33 and later have)")
def test_minimax_h3_trains_both_streams_sample_by_sample_and_its_loss_is_comfyuis(minimax_h3_file):
    """MiniMax H3 (ComfyUI's FLOW_AV objective: its audio carried on the video's noise schedule, 4x at shifts 12 and
    3): each sample's loss is the video stream's plus the audio stream's, of ComfyUI's own sampler output on that
    sample's packed latent (the latent shapes set on the model as its sampler sets them), with that sample's own
    caption, to 1e-6; the clean audio goes in carried as the sampler carries it. The DiT blocks' layers take
    gradients, the same checkpointed as not (its blocks add into their input in place). A preview shows the video
    stream of what KSampler makes. A dataset without audio latents, pipeline stages and a batch size over 1 (captions
    of other lengths would be stacked repeated to one) are refused, naming the input and the setting."""
    import comfy.sampler_helpers
    import comfy.samplers
    import comfy.utils
    from types import SimpleNamespace

    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.data.dataset_checks import check_dataset_for_family
    from ingraph_trainer.trainer.models import UnsupportedSetting, family_for
    from ingraph_trainer.trainer.models.minimax_h3 import samples
    from ingraph_trainer.trainer.parallel.memory import memory_savers
    patcher = load_with_unet_loader(minimax_h3_file)
    family = family_for(patcher.model, patcher=patcher)
    model = patcher.model
    assert family.name == "minimax_h3" and family.prediction == "flow" and model.model_sampling.audio_scale == 4.0
    targets = family.adapter_targets("attention_ff")
    assert targets and all(t.startswith("blocks.") for t in targets) and len(targets) > len(
        family.adapter_targets("attention"))
    batch = minimax_h3_batch()
    one = samples(batch)[0]
    x0, _, _ = family.audio_video_noising(one)
    video, audio = comfy.utils.unpack_latents(x0, family.latent_shapes(one))
    torch.testing.assert_close(audio, 4.0 * one.audio)  # carried onto the video's schedule
    torch.testing.assert_close(video, one.latents)  # (its latent format's scale is 1)
    with torch.no_grad():
        ours = family.loss(batch, reduce=False)
        theirs = []
        for sample in samples(batch):
            x0, shapes = comfy.utils.pack_latents([sample.latents, sample.audio])
            noise, _ = comfy.utils.pack_latents([sample.noise, sample.audio_noise])
            model.latent_shapes = shapes  # what the sampler's inner_sample sets
            try:
                x0 = model.process_latent_in(x0)
                sigma = family.sigmas(sample.timesteps)
                x = model.model_sampling.noise_scaling(sigma.view(-1, 1, 1), noise, x0)
                out = comfy_sampler_output(patcher, x, sigma, [[sample.cond, {}]], noise, latent_shapes=shapes)
            finally:
                model.latent_shapes = None
            streams = zip(comfy.utils.unpack_latents(out, shapes), comfy.utils.unpack_latents(noise - x0, shapes),
                          strict=True)
            theirs.append(sum((o - t).pow(2).mean() for o, t in streams))
    assert len(theirs) == len(ours) == 2
    torch.testing.assert_close(ours, torch.stack(theirs), **LOSS_SAME)
    with torch.no_grad():  # each sample is conditioned on its own caption: another second caption moves the second
        other = family.loss(minimax_h3_batch(captions=1), reduce=False)
    assert torch.equal(other[0], ours[0]) and not torch.allclose(other[1], ours[1]), (other, ours)
    grads = []
    for checkpointing in (False, True):
        family = family_for(load_with_unet_loader(minimax_h3_file).model)
        family.prepare_for_training()
        params = inject_adapter(family.diffusion_model, targets, "lora", 2, 2.0, 0.0)
        torch.manual_seed(3)
        for param in params:  # both halves of each LoRA non-zero: every one takes a gradient
            param.data.normal_(0, 0.1)
        memory_savers(family, checkpointing, 0)
        family.loss(batch).backward()
        grads.append([param.grad for param in params])
    assert len(grads[0]) == len(grads[1]) and all(g.abs().sum() > 0 for g in grads[0])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)
    # the memory plan's meta pass runs it as a step does (its forward reads the timestep's value): the LoRA's
    # activations counted
    from ingraph_trainer.trainer.parallel.memory_sizes import activation_profile
    with torch.no_grad():
        inputs = family.model_inputs(samples(batch)[0])
    profile = activation_profile(family, inputs, family.checkpoint_blocks(), None, torch.device("cpu"))
    assert profile.measured and sum(profile.saved) > 0
    # a preview samples it as KSampler does from an empty latent (its latent format makes it a video and audio pair)
    # and shows the video stream: 24 channels, one latent frame's worth of an image at 16x
    from ingraph_trainer.trainer.sampling import sample_latent
    with torch.no_grad():
        preview = sample_latent(patcher, [[batch.cond[:1], {}]], [[batch.cond[1:], {}]], 0, steps=1, cfg=1.0,
                                sampler="euler", scheduler="simple", width=64, height=64)
    assert preview.shape[:2] == (1, 24) and preview.shape[-2:] == (4, 4) and torch.isfinite(preview).all()
    silent = SimpleNamespace(audio=False, reference_slots=0, sizes=None, text_keys=[], sources=[])
    with pytest.raises(UnsupportedSetting, match=r"^data.manifest: MiniMax H3 generates video with sound, and these "
                                                 r"items carry no audio latents: .*Cache Latents' audio_vae"):
        check_dataset_for_family(silent, family)
    with pytest.raises(UnsupportedSetting, match="distributed.pipeline_stages: MiniMax H3"):
        family.pipeline_layers()
    from ingraph_trainer.trainer.spec import RunSpec, TrainSpec
    family.check_settings(RunSpec(train=TrainSpec(batch_size=1)))
    with pytest.raises(UnsupportedSetting, match="train.batch_size: ComfyUI's MiniMax H3 takes one caption a call"):
        family.check_settings(RunSpec(train=TrainSpec(batch_size=2)))


@pytest.mark.skipif(not ON_COMFYUI_033, reason="skipped: this ComfyUI has no MiniMax H3 (0.33 and later have)")
def test_minimax_h3s_own_audio_vae_takes_from_the_cache_what_its_stand_in_takes(tmp_path):
    """ComfyUI's own MiniMax H3 audio VAE (its class at its released size, 151M parameters of random weights, built
    as Load VAE builds it from a file's weights) and the stand-in the graph tests use, each caching a 24 fps clip with
    sound in a 22-frame item: both are handed the same sound ([1, 37 x 800 samples, stereo] at 32 kHz), and the
    cache keeps the real one's latents at the shape it keeps the stand-in's, [32, stereo, 37]: the audio latents
    Empty MiniMax H3 AV Latent gives 22 frames. (Its video VAE, 2.6B parameters, is too large to build here; its
    stand-in's 16x and 17k + 5 frame counts are ComfyUI's VAE's.)"""
    bootstrap_comfy()
    import comfy.sd
    from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
    from comfy_extras.nodes_minimax_h3 import _empty_av_latent
    from safetensors.torch import load_file

    from clip_caching import VideoVAE, scan
    from media_files import StandInMiniMaxAudioVAE, time_ramp, write_video
    from ingraph_trainer.cache.encoding import encode_latents
    from ingraph_trainer.cache.store import CacheStore
    from ingraph_trainer.trainer.models.base import init_weights
    released = init_weights(MiniMaxH3AudioVAE(), 0)
    released.latents_std.fill_(1.0)
    real = comfy.sd.VAE(sd=released.state_dict())
    assert type(real.first_stage_model) is MiniMaxH3AudioVAE and real.audio_sample_rate == 32000
    real.encoded, encode = [], real.encode
    real.encode = lambda audio: (real.encoded.append(tuple(audio.shape)), encode(audio))[1]
    (tmp_path / "clips").mkdir()
    write_video(tmp_path / "clips" / "a.mkv", 24, fps=24, sound=time_ramp)
    expected = _empty_av_latent(64, 64, 22)[0]["samples"].unbind()[1].shape[1:]
    cached = {}
    for name, vae in (("real", real), ("stand-in", StandInMiniMaxAudioVAE())):
        store = CacheStore(tmp_path / f"cache_{name}")
        dataset, encoded, _ = encode_latents(scan(tmp_path / "clips", frame_buckets="22", fps=24), VideoVAE(), store,
                                             audio_vae=vae)
        assert encoded == len(dataset.items) == len(vae.encoded) == 1 and dataset.audio
        cached[name] = (vae.encoded, [tuple(load_file(str(store.lookup(item.latent).path))["audio"].shape)
                                      for item in dataset.items])
        store.close()
    assert cached["real"] == cached["stand-in"], cached
    assert set(cached["real"][0]) == {(1, 37 * 800, 2)} and set(cached["real"][1]) == {tuple(expected)} == \
        {(32, 2, 37)}, (cached, expected)


@pytest.mark.skipif(not ON_COMFYUI_033, reason="skipped: this ComfyUI has no MiniMax H3 (0.33 and later have)")
def test_minimax_h3_trains_on_clips_with_sound_through_the_graph(video_models_in_server, minimax_h3_file, client):
    """Two 24 fps clips with sound (PCM in .mkv, AAC in .mp4), in items of 5 frames (the shortest MiniMax H3
    generates), cached through Cache Latents with MiniMax H3's video and audio VAEs (stand-ins: the real ones are too
    large here) as the latents Empty MiniMax H3 AV Latent gives 5 frames (2 video latent frames, 8 audio latents),
    train the tiny MiniMax H3 2 steps, its memory plan measured on both streams. The LoRA (on the DiT blocks alone:
    no layer of its text refiner) loads through the stock LoraLoaderModelOnly with no "lora key not loaded", and changes the audio of ComfyUI's own
    MiniMax H3 graph (Empty MiniMax H3 AV Latent → KSampler → LTXVSeparateAVLatent)."""
    import shutil

    from safetensors.torch import load_file

    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    comfy = video_models_in_server
    shutil.copy(minimax_h3_file, comfy.dir("models", "diffusion_models") / minimax_h3_file.name)
    folder = comfy.dir("input", "ingraph_minimax_sound")
    talking_and_waving(folder, frames=12, fps=24)
    model = {"class_type": "UNETLoader", "inputs": {"unet_name": minimax_h3_file.name, "weight_dtype": "default"}}
    graph = training_graph("wan", "minimax_sound", model=model, text_family="minimax_h3", batch_size=1)
    graph["2"] = {"class_type": "InGraphTestStandInMiniMaxVideoVAE", "inputs": {}}
    graph["4"]["inputs"].update(folder="ingraph_minimax_sound", frame_buckets="5", fps=24.0)
    graph["20"] = {"class_type": "InGraphTestStandInMiniMaxAudioVAE", "inputs": {}}
    graph["5"]["inputs"]["audio_vae"] = ["20", 0]
    started = trains_two_steps(client, graph, "minimax_h3")
    # the memory plan ran the model as a step does (both streams, sample by sample)
    assert started["memory_plan"]["parts"]["activations"] > 0, started["memory_plan"]["summary"]
    dataset = load_cached_dataset(str(Path(started["run_dir"]) / "dataset.json"))
    assert dataset.audio and dataset.audio_latents([0, 1]).shape == (2, 32, 2, 8)  # 5 frames at 24 fps, 40 a second
    assert dataset.batch([0, 1])[0].shape == (2, 24, 2, 4, 4)
    adapter = load_file(str(comfy.base_dir / "models" / "loras" / "minimax_sound.safetensors"))
    assert adapter and all(k.startswith("diffusion_model.blocks.") for k in adapter), sorted(adapter)[:3]

    def av_sampling(lora: str | None, prefix: str) -> dict:
        graph = sampling_graph("wan", lora, prefix, unet_name=minimax_h3_file.name, text_family="minimax_h3")
        graph.update({
            "12": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": 5}},
            "17": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["13", 0]}}})
        graph["14"]["inputs"]["samples"] = ["17", 1]  # the audio stream's latent
        return graph
    base, trained = audio_without_and_with_the_lora(comfy, client, av_sampling, "minimax_sound")
    assert base.shape == trained.shape == (1, 32, 2, 8)  # 5 frames at 24 fps, 40 latents a second
    assert (base - trained).abs().max() > 1e-6, "the LoRA did not change the audio"
