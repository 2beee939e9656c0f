"""Clips with sound, for LTX-2's audio stream: each clip item's sound over its own frames is decoded (PyAV),
encoded by the audio VAE and cached beside its video latent, reaches the trainer's batches with noise of its own,
and is refused where it cannot be used (an image or a silent clip with an audio VAE, a model with no audio stream,
a prior set cached otherwise). The audio VAE is a stand-in (media_files.StandInAudioVAE): ComfyUI's needs
torchaudio, which has no wheel for this machine's torch; everything else is the pack's own code on real files."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from clip_caching import SyntheticClip, VideoVAE, scan
from media_files import SIDE, StandInAudioVAE, StandInMiniMaxAudioVAE, time_ramp, write_image, write_video
from ingraph_trainer.cache.audio import SEEK_MARGIN_S
from ingraph_trainer.cache.dataset import prior_problems
from ingraph_trainer.cache.encoding import encode_latents, encode_text
from ingraph_trainer.cache.pixels import DatasetError
from ingraph_trainer.cache.store import CacheStore, write_manifest
from ingraph_trainer.cache.video import ClipError

CLIPS = dict(frame_buckets="9", fps=8, clip_mode="multiple_overlapping")


def clips_with_sound(folder: Path) -> Path:
    """A 16-frame clip (2 s at 8 fps) with a lossless sound that says when it is, and one with AAC sound (48 kHz
    both: the audio VAE's 44.1 kHz is a resampling away)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_video(folder / "a.mkv", 16, fps=8, sound=time_ramp)
    write_video(folder / "b.mp4", 16, fps=8, sound=time_ramp, audio_codec="aac")
    return folder


def cache(folder: Path, store: CacheStore, audio_vae=None, **kw):
    return encode_latents(scan(folder, **{**CLIPS, **kw}), VideoVAE(), store, audio_vae=audio_vae)


def test_each_clip_items_sound_is_cached_beside_its_frames_over_its_own_span(tmp_path):
    """9-frame windows of each 2 s clip (at 8 fps, overlapping): each window's audio latent holds the sound of its
    own 1.125 s, as many latents as LTXV Empty Latent Audio gives 9 frames at 8 fps (28 at 25 a
    second), 8 channels by 16 bins; caching again reuses every entry, and the same clips cached without the audio
    VAE are other entries (no audio in them)."""
    folder = clips_with_sound(tmp_path / "data")
    store = CacheStore(tmp_path / "cache")
    vae = StandInAudioVAE()
    dataset, encoded, reused = cache(folder, store, vae)
    assert encoded == len(dataset.items) == len(vae.encoded) >= 4 and reused == 0 and dataset.audio
    assert {i.start for i in dataset.items} > {0} and {i.frames for i in dataset.items} == {9}
    # 1.125 s at the VAE's 44.1 kHz (the files' 48 kHz resampled), stereo, as VAE.encode takes it, read on to whole
    # blocks of 4096 samples, which its crop then leaves whole (a shorter read would be cropped from its start)
    assert all(shape == (1, 13 * 4096, 2) and 13 * 4096 >= 1.125 * 44100 > 12 * 4096 for shape in vae.encoded)
    count = vae.first_stage_model.num_of_latents_from_frames(9, 8)
    assert count == 28
    hop_s = 1 / 25
    for item in dataset.items:
        shard = load_file(str(store.lookup(item.latent).path))
        assert shard["audio"].shape == (8, count, 16) and shard["latent"].shape[1] == 3
        # the ramp's mean over the k-th window of the item's own span: t / 10 at the window's middle
        start_s = item.start / 8
        expected = torch.tensor([(start_s + (k + 0.5) * hop_s) / 10 for k in range(count)])
        tolerance = 1e-3 if item.path.endswith(".mkv") else 5e-3  # AAC is lossy
        torch.testing.assert_close(shard["audio"][0, :, 0], expected, rtol=0, atol=tolerance, msg=item.path)
        assert torch.equal(shard["audio"][:, :, 0], shard["audio"][:1, :, 0].expand(8, -1))

    again, encoded, reused = cache(folder, store, StandInAudioVAE())
    assert (encoded, reused) == (0, len(dataset.items)) and [i.latent for i in again.items] == [
        i.latent for i in dataset.items]
    silent, encoded, reused = cache(folder, store)
    assert (encoded, reused) == (len(dataset.items), 0) and not silent.audio
    assert not {i.latent for i in silent.items} & {i.latent for i in dataset.items}
    assert "audio" not in load_file(str(store.lookup(silent.items[0].latent).path))
    store.close()


def test_minimax_h3s_audio_vae_caches_40_latents_a_second_on_the_last_axis_over_each_items_own_span(tmp_path):
    """With MiniMax H3's audio VAE (32 kHz, 800 samples a latent, latents [32, stereo, T]): each 22-frame window of
    2 s clips at 24 fps (17k + 5 frames, as MiniMax H3 generates) gets round(22 / 24 * 40) = 37 latents, as Empty
    MiniMax H3 AV Latent gives 22 frames, each the sound of its own 25 ms of the window's span, on the latent's last
    axis, each stereo channel its own. Other frame rates or frame counts are refused, naming the clip."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_video(folder / "a.mkv", 48, fps=24, sound=time_ramp)
    write_video(folder / "b.mp4", 48, fps=24, sound=time_ramp, audio_codec="aac")
    store = CacheStore(tmp_path / "cache")
    vae = StandInMiniMaxAudioVAE()
    dataset, encoded, reused = cache(folder, store, vae, frame_buckets="22", fps=24)
    assert encoded == len(dataset.items) == len(vae.encoded) >= 4 and dataset.audio
    assert {i.start for i in dataset.items} > {0} and {i.frames for i in dataset.items} == {22}
    # 22 / 24 s at 32 kHz, read on to whole blocks of 800 samples: 37 of them (no crop of the item's own sound)
    assert all(shape == (1, 37 * 800, 2) for shape in vae.encoded), vae.encoded
    for item in dataset.items:
        audio = load_file(str(store.lookup(item.latent).path))["audio"]
        assert audio.shape == (32, 2, 37)
        # (up to the clip's last 50 ms, where the 48 to 32 kHz resampler's tail leaves a few samples short)
        inside = [k for k in range(37) if item.start / 24 + (k + 1) / 40 <= 1.95]
        expected = torch.tensor([(item.start / 24 + (k + 0.5) / 40) / 10 for k in inside])
        tolerance = 1e-3 if item.path.endswith(".mkv") else 5e-3  # AAC is lossy
        for channel, sign in ((0, 1.0), (1, -1.0)):  # the left channel and the right, its negative
            torch.testing.assert_close(audio[0, channel, inside], sign * expected, rtol=0, atol=tolerance,
                                       msg=lambda m: f"{item.path}: {m}")
    for buckets, fps in (("22", 25), ("21", 24)):
        with pytest.raises(DatasetError, match=r"^clip .*a\.mkv: its 2[12]-frame items at 2[45] fps: MiniMax H3 "
                                               r"generates 24 fps video of 5, 22, 39"):
            cache(folder, store, StandInMiniMaxAudioVAE(), frame_buckets=buckets, fps=fps)
    store.close()


def test_a_sound_shorter_than_the_item_is_silent_past_its_end(tmp_path):
    """A clip whose sound stops after 1.5 s: its last window (from 0.875 s or later) keeps its latents' count,
    silent (zero) where the sound has ended."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_video(folder / "a.mkv", 16, fps=8, sound=lambda t: time_ramp(t) + 0.5, sound_s=1.5)
    store = CacheStore(tmp_path / "cache")
    dataset, _, _ = cache(folder, store, StandInAudioVAE())
    late = max(dataset.items, key=lambda i: i.start)
    assert late.start >= 7
    audio = load_file(str(store.lookup(late.latent).path))["audio"][0, :, 0]
    assert audio.shape == (28,)
    heard = round((1.5 - late.start / 8) * 25)  # latents before the sound ends
    assert (audio[:heard - 1] > 0.5).all() and torch.equal(audio[heard + 1:], torch.zeros(28 - heard - 1))
    store.close()


def test_an_audio_vae_needs_clips_with_sound_and_names_what_has_none(tmp_path):
    """With an audio VAE, a still image and a clip with no audio track are refused naming the file, and a VAE that
    does not encode audio naming the input."""
    store = CacheStore(tmp_path / "cache")
    folder = clips_with_sound(tmp_path / "with_image")
    write_image(folder / "still.png")
    with pytest.raises(DatasetError, match="image .*still.png: the audio VAE encodes each clip's sound"):
        cache(folder, store, StandInAudioVAE())
    silent = tmp_path / "silent"
    silent.mkdir()
    write_video(silent / "quiet.mp4", 16, fps=8)
    with pytest.raises(ClipError, match="clip .*quiet.mp4 has no audio track"):
        cache(silent, store, StandInAudioVAE())
    with pytest.raises(DatasetError, match="audio_vae: this VAE does not encode audio"):
        cache(clips_with_sound(tmp_path / "data"), store, VideoVAE())
    store.close()


def test_cached_sound_reaches_the_trainers_batches_with_noise_of_its_own(tmp_path):
    """The manifest says the items carry audio; the trainer's batches stack each item's audio latent
    (Batch.audio), and each step draws their noise from a stream of its own (the same on every load, the video
    noise and timesteps those of a run without audio). A family with no audio stream and a prior set cached without
    sound refuse such a dataset before any step, naming the setting."""
    from ingraph_trainer.trainer.data.batch_mix import MixedDataset, load_step, training_batch
    from ingraph_trainer.trainer.data.dataset_checks import check_dataset_for_family, check_eval_references
    from ingraph_trainer.trainer.data.loading import StepSampler, load_cached_dataset
    from ingraph_trainer.trainer.models.base import UnsupportedSetting

    folder = clips_with_sound(tmp_path / "data")
    store = CacheStore(tmp_path / "cache")
    dataset, _, _ = cache(folder, store, StandInAudioVAE())
    dataset, _, _ = encode_text(dataset, SyntheticClip(), store)
    silent, _, _ = cache(folder, store)
    silent, _, _ = encode_text(silent, SyntheticClip(), store)
    store.close()
    manifest = write_manifest(tmp_path / "dataset.json", dataset, tmp_path / "cache")
    assert json.loads(manifest.read_text())["audio"] is True
    silent_manifest = write_manifest(tmp_path / "silent.json", silent, tmp_path / "cache")
    assert json.loads(silent_manifest.read_text())["audio"] is False

    cached_set, silent_set = load_cached_dataset(str(manifest)), load_cached_dataset(str(silent_manifest))
    assert cached_set.audio and not silent_set.audio
    batch = training_batch(cached_set, [0, 3])
    assert batch.audio.shape == (2, 8, 28, 16) and batch.latents.shape == (2, 4, 3, SIDE // 8, SIDE // 8)
    assert training_batch(silent_set, [0, 3]).audio is None
    assert cached_set.audio_latents([1]).shape == (1, 8, 28, 16) and silent_set.audio_latents([1]) is None

    data_spec = SimpleNamespace(caption_dropout=0.0, shuffle_tags=False, masked_loss=True, prior_weight=1.0)
    sampler = StepSampler(cached_set.buckets, 2, seed=5)

    def step(dataset):
        return load_step(dataset, sampler, 0, data_spec, 5, 2, 1, 1, 0)[1]
    (micro,), (again,), (plain,) = step(cached_set), step(cached_set), step(silent_set)
    assert micro.audio.shape == micro.audio_noise.shape == (2, 8, 28, 16)
    assert torch.equal(micro.audio_noise, again.audio_noise) and micro.audio_noise.std() > 0.5
    assert torch.equal(micro.noise, plain.noise) and torch.equal(micro.timesteps, plain.timesteps)
    assert plain.audio is None and plain.audio_noise is None
    args, features = micro.model_inputs()
    assert torch.equal(features["audio"], micro.audio) and "audio" not in plain.model_inputs()[1]

    class NoAudio:
        display_name, reference_input = "Wan", None
        latent_channels, latent_ndim = 4, 5  # the stand-in VAE's channels; a video model's B C T H W

    class AudioVideo(NoAudio):
        display_name, takes_audio = "LTX-2", True
    check_dataset_for_family(cached_set, AudioVideo())
    check_dataset_for_family(silent_set, NoAudio())
    with pytest.raises(UnsupportedSetting, match="data.manifest: its clips carry audio latents, and Wan takes no "
                                                 "audio stream"):
        check_dataset_for_family(cached_set, NoAudio())
    with pytest.raises(ValueError, match="data.prior_manifest: the prior items carry no audio latents"):
        check_dataset_for_family(MixedDataset(cached_set, silent_set), AudioVideo())
    assert MixedDataset(cached_set, cached_set).audio_latents([0, len(cached_set)]).shape == (2, 8, 28, 16)
    # a held-out evaluation set cached the other way would measure another task
    check_eval_references(cached_set, cached_set)
    with pytest.raises(ValueError, match=r"data.eval_manifest \(the eval_dataset input\): its clips' sound was not "
                                         r"cached, the training clips' was"):
        check_eval_references(cached_set, silent_set)
    # the graph's datasets say the same before anything is launched (Train's prior_dataset input)
    assert prior_problems(dataset, silent, "prior_dataset") == [
        "prior_dataset: its items' sound was not cached, unlike the training clips' (Cache Latents' audio_vae); "
        "cache both sets with the same audio_vae, or both without"]
    assert prior_problems(dataset, dataset) == []


def test_distillation_and_models_without_audio_refuse_a_dataset_with_sound_at_queue_time(tmp_path, monkeypatch):
    """The Distill node refuses a dataset whose clips' sound is cached (distillation runs on video alone), naming
    its input, before the model is handed off; so does the trainer's Distiller at start, for a spec written by hand.
    A Train node whose model takes no audio stream refuses it at queue time too (the trainer's rule, on the graph's
    dataset)."""
    from ingraph_trainer.runner.distill_run import check_new_distillation
    from ingraph_trainer.runner.train_run import check_dataset_for_model
    from ingraph_trainer.trainer.data.dataset_checks import distillation_audio_problem
    from ingraph_trainer.trainer.spec import DistillSpec, RunSpec

    monkeypatch.setenv("INGRAPH_CACHE_DIR", str(tmp_path / "cache"))  # where the node reads the shards' headers
    store = CacheStore(tmp_path / "cache")
    folder = clips_with_sound(tmp_path / "data")
    dataset, _, _ = cache(folder, store, StandInAudioVAE())
    silent, _, _ = cache(folder, store)
    store.close()

    class Node:
        title = "Distill"

        def refuse(self, problems):
            if problems:
                raise ValueError(f"{self.title}: " + "; ".join(problems))

    class Model:  # the graph's MODEL, as the runner's trainer-side view (GraphModel) answers for it
        def __init__(self, takes_audio):
            self.family_ = SimpleNamespace(display_name="LTX-2" if takes_audio else "Wan", reference_input=None,
                                           takes_audio=takes_audio, latent_channels=4, latent_ndim=5)

        def family(self):
            return self.family_
    datasets = SimpleNamespace(train=dataset, prior=None)
    with pytest.raises(ValueError, match=r"^Distill: dataset: its clips' sound was cached \(Cache Latents' "
                                         r"audio_vae\); distilling a model's audio stream \(LTX-2's, MiniMax H3's\) is "
                                         r"not yet supported"):
        check_new_distillation(RunSpec(distill=DistillSpec(guidance_scale=1.0)), Model(True), datasets, Node())
    assert distillation_audio_problem(silent, "dataset") is None
    assert distillation_audio_problem(dataset, "data.manifest").startswith("data.manifest: its clips' sound")
    check_dataset_for_model(Model(True), dataset, "Train LoRA")
    check_dataset_for_model(Model(False), silent, "Train LoRA")
    with pytest.raises(ValueError, match=r"^Train LoRA \(Wan model\): dataset: its clips carry audio latents, and "
                                         r"Wan takes no audio stream"):
        check_dataset_for_model(Model(False), dataset, "Train LoRA")


@pytest.mark.parametrize("name, codec, channels, starts_s", [("late.mkv", "pcm_s16le", 2, 0.75),
                                                               ("mono.mkv", "pcm_s16le", 1, 0.0),
                                                               ("surround.mkv", "pcm_s16le", 6, 0.0),
                                                               ("long.mp4", "aac", 2, 0.0)])
def test_sound_is_read_from_each_items_own_time_whatever_the_track(tmp_path, name, codec, channels, starts_s):
    """A 4 s clip's 9-frame windows, the last from 2.875 s (read after a seek, half a second early so that AAC's
    first frame decodes whole): a track that starts 0.75 s late is silent before it; a mono track and a 5.1 one
    (mixed to stereo) say the same time as a stereo one."""
    folder = tmp_path / "data"
    folder.mkdir()

    def sound(t):
        return np.stack([time_ramp(t)[0]] * channels)
    write_video(folder / name, 32, fps=8, sound=sound, audio_codec=codec, sound_starts_s=starts_s,
                sound_s=4.0 - starts_s)
    store = CacheStore(tmp_path / "cache")
    vae = StandInAudioVAE()
    dataset, _, _ = cache(folder, store, vae)
    assert max(i.start for i in dataset.items) / 8 > 2 * SEEK_MARGIN_S  # decoded after a seek
    # stereo (5.1 mixed down); mono as it is, as VAE Encode Audio hands it (ComfyUI's VAE repeats it to stereo)
    assert all(shape[2] == min(channels, 2) for shape in vae.encoded), vae.encoded
    for item in dataset.items:
        audio = load_file(str(store.lookup(item.latent).path))["audio"][0, :, 0]
        middles = torch.tensor([item.start / 8 + (k + 0.5) / 25 for k in range(len(audio))])  # each latent's window
        before, after = middles < starts_s - 0.02, middles > starts_s + 0.02  # (the window across the start: left out)
        assert torch.equal(audio[before], torch.zeros(int(before.sum())))
        # a 5.1 track mixed to stereo: the left channel's share of the mix, whatever FFmpeg's weights (its 5.1
        # downmix adds the centre and the left surround at 0.707 each: 2.41 here)
        share = float(audio[after].dot(middles[after] / 10) / (middles[after] / 10).square().sum())
        assert abs(share - 1) < 0.01 if channels < 6 else 1 < share < 3, (name, share)
        torch.testing.assert_close(audio[after], share * middles[after] / 10, rtol=0,
                                   atol=share * (5e-3 if codec == "aac" else 1e-3), msg=f"{name} from {item.start}")
    store.close()


def test_an_audio_vae_needs_the_dataset_frame_rate_and_items_long_enough_for_one_latent(tmp_path):
    """fps 0 (each clip at its own rate) leaves the sound's timing unknown to the model: refused naming fps; a
    1-frame item at 60 fps lasts under one audio latent (1/25 s): refused naming the clip."""
    folder = clips_with_sound(tmp_path / "data")
    store = CacheStore(tmp_path / "cache")
    with pytest.raises(DatasetError, match="fps: the clips' sound is timed by their frames"):
        cache(folder, store, StandInAudioVAE(), fps=0)
    with pytest.raises(DatasetError, match=r"clip .*a.mkv: its 1-frame items last 0.017 s at 60 fps, shorter than "
                                           r"one audio latent"):
        cache(folder, store, StandInAudioVAE(), fps=60, frame_buckets="1", clip_mode="single_beginning")
    store.close()


def test_each_rank_gets_its_own_slice_of_the_global_audio_noise(tmp_path):
    """Two data-parallel ranks draw the global batch's audio noise once and take their slots of it, as they do the
    video noise: together they train on what one process does."""
    from ingraph_trainer.trainer.data.batch_mix import load_step
    from ingraph_trainer.trainer.data.loading import StepSampler, load_cached_dataset
    folder = clips_with_sound(tmp_path / "data")
    store = CacheStore(tmp_path / "cache")
    dataset, _, _ = cache(folder, store, StandInAudioVAE())
    dataset, _, _ = encode_text(dataset, SyntheticClip(), store)
    store.close()
    cached_set = load_cached_dataset(str(write_manifest(tmp_path / "dataset.json", dataset, tmp_path / "cache")))
    data_spec = SimpleNamespace(caption_dropout=0.0, shuffle_tags=False, masked_loss=True, prior_weight=1.0)
    sampler = StepSampler(cached_set.buckets, 2, seed=3)
    (one,) = load_step(cached_set, sampler, 1, data_spec, 3, 2, 1, 1, 0)[1]
    ranks = [load_step(cached_set, sampler, 1, data_spec, 3, 1, 1, 2, rank)[1][0] for rank in (0, 1)]
    assert one.audio_noise.shape[0] == 2 and all(r.audio_noise.shape[0] == 1 for r in ranks)
    assert torch.equal(torch.cat([r.audio_noise for r in ranks]), one.audio_noise)
    assert torch.equal(torch.cat([r.audio for r in ranks]), one.audio)
