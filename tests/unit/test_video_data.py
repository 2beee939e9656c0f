"""Video datasets and reference images: clips (video files and folders of frames) cut into frame-bucket items at a
chosen fps, decoded lazily, cached as 5-D video latents in the content-keyed cache (an edited clip re-encoded
alone), reference images cached beside their item's latent, and the trainer's batches of both. Unit tests with a
stand-in VAE; one graph run trains Wan on clips and an image with ComfyUI's own Wan VAE."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import SUITE_EVAL_QUANTILES
from clip_caching import SyntheticClip, VideoVAE, scan
from media_files import SIDE, write_frames, write_image, write_video
from ingraph_trainer.cache.buckets import BucketSettings
from ingraph_trainer.cache.pixels import DatasetError, load_clip_item_tensor
from ingraph_trainer.cache.encoding import encode_latents, encode_text
from ingraph_trainer.cache.store import CacheStore, write_manifest
from ingraph_trainer.cache.video import clip_spans, parse_frame_buckets, probe_clip


class ImageVAE(VideoVAE):
    latent_dim = 2

    def get_sd(self):  # another VAE: its latents are cached under other keys
        return {"w": torch.ones(2)}

    def encode(self, pixels):
        self.encoded.append(pixels.shape[0])
        return torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1), 8)[:, :1].repeat(1, 4, 1, 1)


# --- frame buckets ------------------------------------------------------------------------------------------

def test_frame_buckets_cut_a_clip_as_diffusion_pipe_does():
    assert parse_frame_buckets("33, 1,17, 17") == (1, 17, 33)
    with pytest.raises(ValueError, match="frame_buckets"):
        parse_frame_buckets("1, many")
    buckets = (1, 17, 33)
    assert clip_spans(40, buckets) == [(0, 33)]  # the longest bucket that fits, from the start
    assert clip_spans(40, buckets, "single_middle") == [(3, 33)]
    assert clip_spans(20, buckets) == [(0, 17)]
    assert clip_spans(5, buckets) == [(0, 1)]
    assert clip_spans(5, (17, 33)) == []  # too short for every bucket
    # windows covering the whole clip, evenly spaced, overlapping where they must
    assert clip_spans(70, buckets, "multiple_overlapping") == [(0, 33), (18, 33), (37, 33)]
    assert clip_spans(33, buckets, "multiple_overlapping") == [(0, 33)]


def test_a_clip_at_a_chosen_fps_becomes_the_right_items(tmp_path):
    """A 2 s video at 8 fps is 16 frames at 8 fps and 8 at 4 fps; a folder of 6 frames is 6 frames whatever
    the fps. Each becomes items of the longest bucket that fits; images stay 1-frame items beside them."""
    write_video(tmp_path / "walk.mp4", 16, fps=8)
    write_frames(tmp_path / "wave", 6)
    write_image(tmp_path / "still.png")
    info = probe_clip(tmp_path / "walk.mp4")
    assert (info.width, info.height, len(info.times)) == (SIDE, SIDE, 16)
    assert info.frame_count(8) == 16 and info.frame_count(4) == 8 and info.frame_count(16) == 32

    def spans(dataset):
        return sorted((Path(i.path).name, i.start, i.frames) for i in dataset.items)
    assert spans(scan(tmp_path, frame_buckets="1, 5, 9", fps=8)) == [
        ("still.png", 0, 0), ("walk.mp4", 0, 9), ("wave", 0, 5)]
    assert spans(scan(tmp_path, frame_buckets="1, 5, 9", fps=4)) == [
        ("still.png", 0, 0), ("walk.mp4", 0, 5), ("wave", 0, 5)]
    assert spans(scan(tmp_path, frame_buckets="1, 5", fps=8, clip_mode="multiple_overlapping")) == [
        ("still.png", 0, 0), ("walk.mp4", 0, 5), ("walk.mp4", 4, 5), ("walk.mp4", 7, 5), ("walk.mp4", 11, 5),
        ("wave", 0, 5), ("wave", 1, 5)]
    dataset = scan(tmp_path, frame_buckets="9", fps=8)  # the 6-frame folder is too short: skipped, said so
    assert "wave" in dataset.skipped_files and {Path(i.path).name for i in dataset.items} == {"still.png", "walk.mp4"}
    write_image(tmp_path / "walk.mask.png", size=(SIDE // 2, SIDE))
    with pytest.raises(DatasetError, match="walk.mask.png is 32x64 but its image walk.mp4 is 64x64"):
        scan(tmp_path, frame_buckets="1, 5", fps=8)


def test_a_clip_mask_weighs_every_frame_alike(tmp_path):
    """name.mask.png beside a clip: cached on the latent grid once, broadcast over the latent frames, and the
    trainer's batch carries it ([B, 1, 1, h, w]) beside the 5-D latents."""
    from PIL import Image
    from ingraph_trainer.trainer.data.batch_mix import training_batch
    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    data = tmp_path / "data"
    write_frames(data / "b", 9)
    mask = Image.new("L", (SIDE, SIDE), 255)
    mask.paste(0, (SIDE // 2, 0, SIDE, SIDE))  # the right half is ignored
    mask.save(data / "b.mask.png")
    store = CacheStore(tmp_path / "cache")
    dataset, _, _ = cached(data, store, frame_buckets="9", fps=8)
    dataset, _, _ = encode_text(dataset, SyntheticClip(), store)
    store.close()
    cached_set = load_cached_dataset(str(write_manifest(tmp_path / "dataset.json", dataset, tmp_path / "cache")))
    batch = training_batch(cached_set, [0, 0])
    assert batch.latents.shape == (2, 4, 3, SIDE // 8, SIDE // 8)
    assert batch.mask.shape == (2, 1, 1, SIDE // 8, SIDE // 8)
    half = SIDE // 16
    assert torch.all(batch.mask[..., :half] == 1) and torch.all(batch.mask[..., half:] == 0)


@pytest.mark.parametrize("name,codec", [("a.webm", "libvpx-vp9"), ("a.mov", "mpeg4"), ("a.gif", "gif")])
def test_webm_mov_and_gif_are_clips_too(tmp_path, name, codec):
    write_video(tmp_path / name, 10, fps=10, codec=codec)
    (item,) = scan(tmp_path, frame_buckets="1, 9", fps=5).items  # 1 s at 5 fps: 5 frames, bucket 1
    assert (Path(item.path).name, item.frames) == (name, 1)
    (item,) = scan(tmp_path, frame_buckets="1, 9", fps=10).items
    frames = load_clip_item_tensor(item, 10.0)
    levels = (frames.mean(dim=(1, 2, 3)) * 255).round()
    assert frames.shape == (9, SIDE, SIDE, 3) and torch.allclose(levels, 5 * torch.arange(9.0), atol=6), levels


def test_a_phone_clip_is_decoded_upright_by_its_display_rotation(tmp_path):
    """A portrait phone clip is stored landscape (64x32, its left half white) with a display matrix turning it a
    quarter counter-clockwise: it is probed as 32x64, bucketed portrait, and decoded upright (the stored left half
    at the bottom), as players show it. Two frames: x264's decoder gives them only when flushed."""
    import av
    with av.open(str(tmp_path / "phone.mp4"), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.set_display_rotation(90)
        stored = np.zeros((32, 64, 3), dtype=np.uint8)
        stored[:, :32] = 255
        for _ in range(2):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(stored, format="rgb24")))
        container.mux(stream.encode())
    info = probe_clip(tmp_path / "phone.mp4")
    assert (info.width, info.height, info.rotation) == (32, 64, 90)
    (item,) = scan(tmp_path, frame_buckets="2", fps=8,
                   buckets=BucketSettings(resolution=128, min_side=64, max_side=256, max_upscale=4.0)).items
    assert item.bucket[1] > item.bucket[0], item.bucket  # portrait
    (item,) = scan(tmp_path, frame_buckets="2", fps=8).items  # 64x64: rows 32..96 of the 64x128 upright
    frames = load_clip_item_tensor(item, 8.0)
    rows = frames.mean(dim=(0, 2, 3))
    assert frames.shape == (2, SIDE, SIDE, 3) and rows[:SIDE // 2 - 4].max() < 0.1 and rows[SIDE // 2 + 4:].min() > 0.9


def test_an_unreadable_video_is_named(tmp_path):
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all" * 10)
    with pytest.raises(DatasetError, match="cannot read video .*broken.mp4"):
        scan(tmp_path)


# --- lazy decoding ------------------------------------------------------------------------------------------

def test_clip_items_decode_lazily_and_resample_to_fps(tmp_path):
    """An item's frames are the right source frames at the dataset's fps, and decoding stops after the last one
    it needs: the first 5 frames of a 48-frame video decode 5 frames, not 48."""
    write_video(tmp_path / "long.mp4", 48, fps=8)
    (item,) = scan(tmp_path, frame_buckets="5", fps=8).items
    stats = {}
    frames = load_clip_item_tensor(item, 8.0, stats=stats)
    assert frames.shape == (5, SIDE, SIDE, 3) and stats["decoded"] == 5
    levels = (frames.mean(dim=(1, 2, 3)) * 255).round()
    assert torch.allclose(levels, torch.tensor([0., 5, 10, 15, 20]), atol=2)
    # at 4 fps every other source frame: 24 frames, whose middle window starts at frame 9 (source frame 18)
    dataset = scan(tmp_path, frame_buckets="5", fps=4, clip_mode="single_middle")
    (item,) = dataset.items
    assert (item.start, item.frames) == (9, 5)
    frames = load_clip_item_tensor(item, 4.0, stats=stats)
    levels = (frames.mean(dim=(1, 2, 3)) * 255).round()
    assert torch.allclose(levels, torch.tensor([90., 100, 110, 120, 130]), atol=3)  # source frames 18..26
    assert stats["decoded"] <= 27


def test_an_item_deep_in_a_clip_seeks_to_the_keyframe_before_it(tmp_path):
    """With a keyframe every 8 frames, the middle 5 frames (21..25) of 48 decode from frame 16, not from 0."""
    write_video(tmp_path / "long.mp4", 48, fps=8, keyframe_every=8)
    (item,) = scan(tmp_path, frame_buckets="5", fps=8, clip_mode="single_middle").items
    stats = {}
    frames = load_clip_item_tensor(item, 8.0, stats=stats)
    levels = (frames.mean(dim=(1, 2, 3)) * 255).round()
    assert item.start == 21 and torch.allclose(levels, torch.tensor([105., 110, 115, 120, 125]), atol=2)
    assert stats["decoded"] <= 10


# --- the cache ----------------------------------------------------------------------------------------------

def cached(folder, store, vae=None, **kw):
    dataset = scan(folder, **kw)
    dataset, encoded, reused = encode_latents(dataset, vae or VideoVAE(), store)
    return dataset, encoded, reused


def test_clips_cache_5d_latents_and_an_edited_clip_is_reencoded_alone(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_video(folder / "a.mp4", 12, fps=8)
    write_frames(folder / "b", 10)
    write_image(folder / "still.png")
    store = CacheStore(tmp_path / "cache")
    kw = dict(frame_buckets="1, 5, 9", fps=8, clip_mode="multiple_overlapping")
    vae = VideoVAE()
    dataset, encoded, reused = cached(folder, store, vae, **kw)
    assert (encoded, reused) == (5, 0) and sorted(vae.encoded) == [1, 9, 9, 9, 9]
    shapes = {(Path(i.path).name, i.start): tuple(load_file(str(store.lookup(i.latent).path))["latent"].shape)
              for i in dataset.items}
    assert shapes[("a.mp4", 0)] == (4, 3, SIDE // 8, SIDE // 8)  # 9 frames: 3 latent frames
    assert shapes[("still.png", 0)] == (4, 1, SIDE // 8, SIDE // 8)

    # editing one frame of the frame folder re-encodes that clip's items only (2 windows), nothing else
    write_image(folder / "b" / "0003.png", level=255)
    vae = VideoVAE()
    dataset2, encoded, reused = cached(folder, store, vae, **kw)
    assert (encoded, reused) == (2, 3) and vae.encoded == [9, 9]
    changed = {Path(a.path).name for a, b in zip(dataset.items, dataset2.items, strict=True) if a.latent != b.latent}
    assert changed == {"b"}
    # another fps changes which frames a video's items hold: its items are re-encoded, the frame folder's not
    vae = VideoVAE()
    _, encoded, reused = cached(folder, store, vae, **{**kw, "fps": 4})
    assert (encoded, reused) == (2, 3) and vae.encoded == [5, 5]
    store.close()


def test_clips_need_a_video_vae_unless_single_frames(tmp_path):
    write_video(tmp_path / "a.mp4", 12, fps=8)
    store = CacheStore(tmp_path / "cache")
    with pytest.raises(DatasetError, match="a.mp4.*need a video VAE"):
        cached(tmp_path, store, ImageVAE(), frame_buckets="1, 9", fps=8)
    dataset, encoded, _ = cached(tmp_path, store, ImageVAE(), frame_buckets="1", fps=8)  # first frames as images
    assert encoded == 1 and dataset.items[0].frames == 1
    store.close()


# --- reference images ---------------------------------------------------------------------------------------

def test_reference_images_are_found_matched_and_counted(tmp_path):
    data, refs = tmp_path / "data", tmp_path / "refs"
    data.mkdir(), refs.mkdir()
    write_image(data / "cat.png"), write_image(data / "cat.ref.png", 10), write_image(data / "cat.ref2.png", 20)
    write_image(data / "dog.png"), write_image(data / "dog.ref.png", 30)
    with pytest.raises(DatasetError, match="dog.png has 1 reference image.*other items have 2"):
        scan(data)
    write_image(data / "dog.ref2.png", 40)
    items = {Path(i.path).name: i.references for i in scan(data).items}
    assert items == {"cat.png": (str(data / "cat.ref.png"), str(data / "cat.ref2.png")),
                     "dog.png": (str(data / "dog.ref.png"), str(data / "dog.ref2.png"))}
    (data / "dog.ref.png").unlink()
    with pytest.raises(DatasetError, match="dog.png: its reference images are numbered \\[2\\]"):
        scan(data)
    # a second folder matched by name
    for name in ("cat.ref.png", "cat.ref2.png", "dog.ref2.png"):
        (data / name).unlink()
    write_image(refs / "cat.png", 50), write_image(refs / "dog.png", 60)
    items = {Path(i.path).name: i.references for i in scan(data, reference_folder=refs).items}
    assert items == {"cat.png": (str(refs / "cat.png"),), "dog.png": (str(refs / "dog.png"),)}
    # the reference folder kept inside the dataset folder is not read as a clip of frames
    inner = data / "refs"
    inner.mkdir()
    write_image(inner / "cat.png", 50), write_image(inner / "dog.png", 60)
    items = {Path(i.path).name: i.references for i in scan(data, reference_folder=inner).items}
    assert items == {"cat.png": (str(inner / "cat.png"),), "dog.png": (str(inner / "dog.png"),)}


def test_a_reference_gets_its_targets_crop_and_flip(tmp_path):
    """Random crop and flips: a reference holding its target's picture (other bytes: a PNG text chunk; or twice the
    size) is cached with exactly its target's crop box and flip, so an edit pair stays aligned pixel for pixel.
    For a clip, its start image is cropped as its frames are."""
    from PIL import Image, PngImagePlugin
    data = tmp_path / "data"
    data.mkdir()
    picture = Image.fromarray(np.random.RandomState(0).randint(0, 256, (SIDE, SIDE * 3 // 2, 3), dtype=np.uint8))
    picture.save(data / "cat.png")
    other_bytes = PngImagePlugin.PngInfo()
    other_bytes.add_text("comment", "the same picture, another file")
    picture.save(data / "cat.ref.png", pnginfo=other_bytes)
    picture.save(data / "dog.png")
    picture.resize((picture.width * 2, picture.height * 2), Image.Resampling.NEAREST).save(data / "dog.ref.png")
    frames = data / "walk"  # a clip of 5 such frames with the first frame as its start image
    frames.mkdir()
    for k in range(5):
        picture.save(frames / f"{k:04d}.png")
    picture.save(data / "walk.ref.png", pnginfo=other_bytes)
    store = CacheStore(tmp_path / "cache")
    buckets = BucketSettings(resolution=SIDE, enabled=False, crop="random", flip=True)
    dataset, _, _ = cached(data, store, frame_buckets="1, 5", fps=8, buckets=buckets)
    assert len(dataset.items) == 6 and {i.flip for i in dataset.items} == {False, True}
    for item in dataset.items:
        shard = load_file(str(store.lookup(item.latent).path))
        latent, reference = shard["latent"], shard["reference0"]
        if item.is_clip:  # the start image's latent frame against the clip's first
            latent, reference = latent[:, :1], reference[:, :1]
        tolerance = 2e-2 if Path(item.path).name == "dog.png" else 1e-6  # resampled from twice the size
        assert torch.allclose(latent, reference, atol=tolerance), (item.path, item.flip,
                                                                   (latent - reference).abs().max())
    store.close()


def test_each_window_of_a_clip_starts_from_its_own_first_frame(tmp_path):
    """A 13-frame clip cut into 3 overlapping windows (frames 0, 4, 8 on) with a start image beside it: the window
    at the clip's start takes walk.ref.png, each later window its own first frame (as an image-to-video model sees
    it continued), cropped as its frames are."""
    data = tmp_path / "data"
    write_frames(data / "walk", 13)  # frame k at level 10 k
    write_image(data / "walk.ref.png", level=200)
    store = CacheStore(tmp_path / "cache")
    dataset, _, _ = cached(data, store, frame_buckets="5", fps=8, clip_mode="multiple_overlapping")
    assert [i.start for i in dataset.items] == [0, 4, 8]
    for item in dataset.items:
        shard = load_file(str(store.lookup(item.latent).path))
        start = shard["reference0"][:, 0]
        if item.start == 0:
            assert torch.allclose(start, torch.tensor(200 / 255), atol=1e-3)
        else:
            assert torch.allclose(start.mean(), torch.tensor(10 * item.start / 255), atol=1e-3)
            assert torch.equal(start, shard["latent"][:, 0])
        assert torch.allclose(shard["reference0"][:, 1:], torch.tensor(0.5))  # gray frames after it
    store.close()


def test_only_a_numbered_frame_sequence_is_a_clip_other_subfolders_are_images(tmp_path, caplog):
    """A subfolder is a clip only when its images are one numbered sequence (0000.png ... 0004.png); a subfolder
    of photos (other names, numbers with gaps, or images with their own captions) is read as images, each matched
    to its caption and mask inside that subfolder; the log says what each subfolder was read as, and why."""
    import logging
    from PIL import Image
    data = tmp_path / "data"
    write_frames(data / "wave", 5)
    write_image(data / "dog.png", 10)
    (data / "holiday").mkdir()
    write_image(data / "holiday" / "dog.png", 20), write_image(data / "holiday" / "beach.png", 30)
    (data / "holiday" / "beach.txt").write_text("a beach")
    Image.new("L", (SIDE, SIDE), 255).save(data / "holiday" / "dog.mask.png")  # this dog's, not the top one's
    (data / "burst").mkdir()  # a camera's numbering with a gap: photos
    for n in (1, 2, 7):
        write_image(data / "burst" / f"IMG_{n:04d}.png", n)
    (data / "captioned").mkdir()  # one numbered sequence, but each image has a caption of its own: photos
    for n in range(3):
        write_image(data / "captioned" / f"{n}.png", n), (data / "captioned" / f"{n}.txt").write_text(f"photo {n}")
    with caplog.at_level(logging.INFO, logger="ingraph_trainer"):
        dataset = scan(data, frame_buckets="1, 5", fps=8)
    items = {Path(i.path).relative_to(data).as_posix(): i for i in dataset.items}
    assert sorted(items) == ["burst/IMG_0001.png", "burst/IMG_0002.png", "burst/IMG_0007.png", "captioned/0.png",
                             "captioned/1.png", "captioned/2.png", "dog.png", "holiday/beach.png",
                             "holiday/dog.png", "wave"]
    assert items["wave"].frames == 5 and not any(i.is_clip for name, i in items.items() if name != "wave")
    assert items["holiday/beach.png"].caption == "a beach" and items["captioned/2.png"].caption == "photo 2"
    assert items["holiday/dog.png"].mask_source.endswith("holiday/dog.mask.png") and not items["dog.png"].mask_source
    logged = caplog.text
    assert "read as clips" in logged and "wave (5 frames numbered 0..4)" in logged
    assert "burst (numbers 1..7 are not evenly spaced" in logged and "holiday (beach.png is not a numbered" in logged
    assert "captioned (0.png has a caption file of its own)" in logged


def test_a_frame_folder_is_read_in_frame_number_order(tmp_path):
    from ingraph_trainer.cache.video import frame_files
    folder = tmp_path / "clip"
    folder.mkdir()
    for k in (1, 2, 10, 11):  # unpadded numbers: name order would put 10 and 11 before 2
        write_image(folder / f"{k}.png", k)
    assert [Path(f).name for f in frame_files(folder, (".png",))] == ["1.png", "2.png", "10.png", "11.png"]


def test_references_and_clips_reach_the_trainer_batch(tmp_path):
    """Cached references come back as Batch.references ([B, C, T, h, w] per slot), clips as 5-D latents in a
    bucket of their own frame count; a family that takes no references refuses them, naming the setting."""
    from ingraph_trainer.trainer.data.batch_mix import training_batch
    from ingraph_trainer.trainer.data.dataset_checks import check_dataset_for_family
    from ingraph_trainer.trainer.data.loading import StepSampler, load_cached_dataset
    from ingraph_trainer.trainer.models.base import UnsupportedSetting

    data = tmp_path / "data"
    data.mkdir()
    write_video(data / "a.mp4", 12, fps=8)
    write_frames(data / "b", 10)
    write_image(data / "still.png", size=(SIDE, SIDE))
    for stem, level in (("a", 10), ("b", 100), ("still", 200)):
        write_image(data / f"{stem}.ref.png", level)
    store = CacheStore(tmp_path / "cache")
    dataset, _, _ = cached(data, store, frame_buckets="1, 9", fps=8)
    dataset, _, _ = encode_text(dataset, SyntheticClip(), store)
    store.close()
    manifest = write_manifest(tmp_path / "dataset.json", dataset, tmp_path / "cache")
    assert json.loads(manifest.read_text())["fields"][-2:] == ["frames", "references"]

    cached_set = load_cached_dataset(str(manifest))
    assert sorted(set(cached_set.buckets)) == [(SIDE, SIDE), (SIDE, SIDE, 9)] and cached_set.reference_slots == 1
    sampler = StepSampler(cached_set.buckets, 2, seed=0)
    for step in range(sampler.batches_per_epoch):
        indices = sampler.indices(step)
        batch = training_batch(cached_set, indices)
        frames = 3 if len(cached_set.buckets[indices[0]]) == 3 else 1
        assert batch.latents.shape == (2, 4, frames, SIDE // 8, SIDE // 8)
        (ref,) = batch.references
        assert ref.shape == batch.latents.shape  # a clip's start image is followed by gray frames to its length
    # each item's own reference, on its bucket: the stand-in VAE's latent is the image's red level, then gray
    by_source = {Path(s).name: i for i, s in enumerate(cached_set.sources)}
    (ref,) = training_batch(cached_set, [by_source["a.mp4"], by_source["b"]]).references
    assert torch.allclose(ref[:, :, 0].mean(dim=(1, 2, 3)), torch.tensor([10 / 255, 100 / 255]), atol=1e-3)
    assert torch.allclose(ref[:, :, 1:], torch.tensor(0.5))
    (ref,) = training_batch(cached_set, [by_source["still.png"]] * 2).references
    assert ref.shape == (2, 4, 1, SIDE // 8, SIDE // 8)
    assert torch.allclose(ref.mean(), torch.tensor(200 / 255), atol=1e-3)

    class NoReferences:
        display_name, reference_input = "SDXL", None
        latent_channels, latent_ndim = 4, 5  # the stand-in video VAE's latents (the items are clips and stills)

        def read_dataset(self, dataset):
            pass

    class Edit(NoReferences):
        display_name, reference_input = "Flux Kontext", "reference_latents"
    check_dataset_for_family(cached_set, Edit())
    with pytest.raises(UnsupportedSetting, match="data.manifest: its items carry 1 reference image.*SDXL.*"
                                                 "reference_input"):
        check_dataset_for_family(cached_set, NoReferences())
    # a run with prior images (here the same set again) serves references from both, evaluation included
    from ingraph_trainer.trainer.data.batch_mix import MixedDataset
    mixed = MixedDataset(cached_set, cached_set)
    still = by_source["still.png"]
    (ref,) = mixed.references([still, len(cached_set) + still])
    assert mixed.reference_slots == 1 and torch.equal(ref[0], ref[1])
    # what the trainer builds at start: refused there, before any step
    from types import SimpleNamespace
    from ingraph_trainer.trainer.data.batch_mix import build_training_data
    spec = SimpleNamespace(manifest=str(manifest), prior_manifest=None, shuffle=True, caption_dropout=0.0)
    assert build_training_data(spec, 2, 0, Edit())[0].reference_slots == 1
    with pytest.raises(UnsupportedSetting, match="SDXL takes none"):
        build_training_data(spec, 2, 0, NoReferences())
    # on pipeline stages: Qwen-Image-Edit's take them, the others refuse (pipeline.check_data: test_training_features)
    assert build_training_data(spec, 2, 0, Edit(), pipeline_stages=2)[0].reference_slots == 1


def test_references_the_model_cannot_take_or_the_eval_set_lacks_are_refused_at_start(tmp_path):
    """At start, before any step: a start-image family (Wan i2v) given items with a second reference image
    (name.ref2.png), and an evaluation set whose items lack the reference images the training items carry, are
    refused naming the setting (and the node input)."""
    from types import SimpleNamespace
    from ingraph_trainer.trainer.data.batch_mix import build_training_data
    from ingraph_trainer.trainer.models.base import UnsupportedSetting

    def manifest(name, references):
        data = tmp_path / name
        data.mkdir()
        write_image(data / "cat.png")
        for slot in ("ref", "ref2")[:references]:
            write_image(data / f"cat.{slot}.png", 90)
        store = CacheStore(tmp_path / "cache")
        dataset, _, _ = cached(data, store, VideoVAE())  # the video model's own VAE
        dataset, _, _ = encode_text(dataset, SyntheticClip(), store)
        store.close()
        return str(write_manifest(tmp_path / f"{name}.json", dataset, tmp_path / "cache"))

    class StartImage:
        display_name, reference_input = "Wan 2.2 image-to-video", "start_image"
        latent_channels, latent_ndim = 4, 5  # the stand-in VAE's channels; a video model's B C T H W

        def read_dataset(self, dataset):
            pass

    def spec(train, eval_set=""):
        return SimpleNamespace(manifest=train, prior_manifest=None, shuffle=True, caption_dropout=0.0,
                               eval_manifest=eval_set)
    one, two, none = manifest("one", 1), manifest("two", 2), manifest("none", 0)
    assert build_training_data(spec(one, one), 1, 0, StartImage())[0].reference_slots == 1
    with pytest.raises(UnsupportedSetting, match="data.manifest: its items carry 2 reference images.*Wan 2.2 "
                                                 "image-to-video takes one start image"):
        build_training_data(spec(two), 1, 0, StartImage())
    with pytest.raises(ValueError, match="data.eval_manifest \\(the eval_dataset input\\): its items carry no "
                                         "reference images, the training items 1"):
        build_training_data(spec(one, none), 1, 0, StartImage())


def test_evaluate_refuses_references_the_model_cannot_take_before_anything_runs(tmp_path, monkeypatch):
    """The Evaluate node runs training's dataset check (dataset_checks.check_dataset_for_family): in the graph, on its
    dataset input, before the MODEL is handed off; and in the trainer's evaluate task, before the model is built."""
    from types import SimpleNamespace

    import ingraph_trainer.runner.model_source as model_source
    from ingraph_trainer.trainer.graph_model import GraphModel
    import ingraph_trainer.trainer.comfy_env as comfy_env
    import ingraph_trainer.trainer.models as models
    from ingraph_trainer.runner.node_run import NodeCall, run_task
    from ingraph_trainer.runner.session import RunDatasets
    from ingraph_trainer.trainer.spec import RunSpec, TrainSpec
    from ingraph_trainer.trainer.tasks.evaluation import run_evaluation
    from ingraph_trainer.trainer.models.base import UnsupportedSetting

    class NoReferences:
        display_name, reference_input = "SDXL", None
        latent_channels, latent_ndim = 4, 4  # the stand-in VAE's channels; an image model's B C H W

        def set_objective(self, **_):
            pass

        def read_dataset(self, dataset):
            pass

    class StartImage(NoReferences):
        display_name, reference_input, latent_ndim = "Wan 2.1 image-to-video", "start_image", 5

    data = tmp_path / "edit"
    data.mkdir()
    write_image(data / "cat.png")
    write_image(data / "cat.ref.png", 90)
    write_image(data / "cat.ref2.png", 30)
    store = CacheStore(tmp_path / "cache")
    dataset, video_dataset = (encode_text(cached(data, store, vae)[0], SyntheticClip(), store)[0]
                              for vae in (ImageVAE(), VideoVAE()))  # each model's own VAE's latents
    store.close()
    assert dataset.reference_slots == video_dataset.reference_slots == 2

    def handed_off(*_):
        raise AssertionError("the MODEL was handed off before the dataset was checked")
    monkeypatch.setattr(model_source, "release_comfy_models", handed_off)
    monkeypatch.setattr(GraphModel, "prediction", "epsilon")
    monkeypatch.setenv("INGRAPH_CACHE_DIR", str(tmp_path / "cache"))  # the node reads the shards' headers there
    for family, refused, graphs in ((NoReferences(), "SDXL takes none", dataset),
                                    (StartImage(), "takes one start image per item", video_dataset)):
        monkeypatch.setattr(models, "family_for", lambda *_, f=family, **__: f)
        with pytest.raises(ValueError, match=f"Evaluate \\({family.display_name} model\\): dataset: its items carry "
                                             f"2 reference image.*{refused}"):
            run_task(RunSpec(task="evaluate", train=TrainSpec(steps=1, eval_quantiles=[0.5], batch_size=1,
                                                              precision="fp32")),
                     SimpleNamespace(model=None), RunDatasets(graphs), None,
                     NodeCall("Evaluate", "1", None, lambda *_: print, lambda: None))

    # the trainer's evaluate task checks again (a run spec written by hand), before any event or model
    manifest = write_manifest(tmp_path / "edit.json", dataset, tmp_path / "cache")
    events = SimpleNamespace(emitted=[], emit=lambda *a, **k: events.emitted.append(a))
    monkeypatch.setattr(comfy_env, "import_comfy", lambda: None)
    monkeypatch.setattr(models, "load_family", lambda *_, **__: NoReferences())
    spec = SimpleNamespace(model=None, train=SimpleNamespace(precision="fp32", flow_shift=1.0, guidance=1.0),
                           data=SimpleNamespace(manifest=str(manifest), eval_manifest=""))
    with pytest.raises(UnsupportedSetting, match="data.manifest \\(the Evaluate node's dataset input\\): its items "
                                                 "carry 2 reference image.*SDXL takes none"):
        run_evaluation(spec, events)
    assert events.emitted == []


def test_a_dataset_cached_for_another_model_is_refused_at_queue_time_before_the_model_is_handed_off(
        tmp_path, monkeypatch):
    """The node reads the first item's shard headers in ComfyUI's cache (dataset_checks._check_encoders, the
    trainer's rule): latents of another VAE's channels, a video VAE's latents for an image model (Wan 2.1's 16
    channels for Flux's 16 failed at the first step with 'too many values to unpack'), or captions of another text
    encoder's width are refused naming the node's input, before the MODEL is handed off or a trainer launched; the
    matching model goes on to the hand-off. The trainer refuses them the same way at start-up, naming
    data.manifest (a run spec written by hand)."""
    from types import SimpleNamespace

    import ingraph_trainer.runner.model_source as model_source
    from ingraph_trainer.trainer.graph_model import GraphModel
    import ingraph_trainer.trainer.models as models
    from ingraph_trainer.runner.node_run import NodeCall, run_task
    from ingraph_trainer.runner.session import RunDatasets
    from ingraph_trainer.trainer.spec import RunSpec, TrainSpec

    from ingraph_trainer.trainer.models.flux import FluxFamily
    from ingraph_trainer.trainer.models.wan import WanFamily

    class Family:  # an image model (its batches' dims, Flux's and SDXL's) that takes the stand-in VAE's 4 channels
        display_name, reference_input, latent_channels = "SDXL", None, 4  # and SyntheticClip's 8-wide text
        latent_ndim = FluxFamily.latent_ndim
        text_input_layer, diffusion_model = r"^txt_in$", torch.nn.ModuleDict({"txt_in": torch.nn.Linear(8, 2)})

        def read_dataset(self, dataset):
            pass
    monkeypatch.setenv("INGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    store = CacheStore(tmp_path / "cache")
    datasets = {}
    for name, vae in (("image", ImageVAE()), ("clip", VideoVAE())):
        (tmp_path / name).mkdir()
        write_image(tmp_path / name / "cat.png") if name == "image" else write_video(tmp_path / name / "cat.mp4", 9)
        dataset, _, _ = cached(tmp_path / name, store, vae, frame_buckets="1, 9", fps=8)
        datasets[name], _, _ = encode_text(dataset, SyntheticClip(), store)
    store.close()

    class HandedOff(Exception):
        pass

    def handed_off(*_):
        raise HandedOff
    monkeypatch.setattr(model_source, "release_comfy_models", handed_off)
    monkeypatch.setattr(GraphModel, "prediction", "epsilon")

    def queued(family, dataset):
        monkeypatch.setattr(models, "family_for", lambda *_, **__: family)
        run_task(RunSpec(task="evaluate", train=TrainSpec(steps=1, eval_quantiles=[0.5], batch_size=1,
                                                          precision="fp32")),
                 SimpleNamespace(model=None), RunDatasets(dataset), None,
                 NodeCall("Evaluate", "1", None, lambda *_: print, lambda: None))
    with pytest.raises(HandedOff):
        queued(Family(), datasets["image"])
    flux = Family()
    flux.display_name, flux.latent_channels = "Flux", 16
    with pytest.raises(ValueError, match=r"Evaluate \(Flux model\): dataset: its latents have 4 channels, and this "
                                         r"Flux model takes 16: .*connect this model's own VAE to Cache Latents' vae"):
        queued(flux, datasets["image"])
    with pytest.raises(ValueError, match=r"dataset: its latents are a video VAE's \[C, T, H, W\] \(\[4, 3, "
                                         r".*and this SDXL model takes an image VAE's \[C, H, W\]"):
        queued(Family(), datasets["clip"])
    video = Family()
    video.display_name, video.latent_ndim = "Wan", WanFamily.latent_ndim
    with pytest.raises(HandedOff):
        queued(video, datasets["clip"])
    # an image VAE's latents (a Flux VAE's for Qwen-Image or Wan) trained before, as one-frame videos of latents the
    # model was never made for
    with pytest.raises(ValueError, match=r"dataset: its latents are an image VAE's \[C, H, W\] \(\[4, 8, 8\]\), "
                                         r"and this Wan model takes a video VAE's \[C, T, H, W\] \(its own VAE is a "
                                         r"video VAE, which makes an image one frame: \[C, 1, H, W\]\): .*connect "
                                         r"this model's own VAE to Cache Latents' vae"):
        queued(video, datasets["image"])
    wide = Family()
    wide.diffusion_model = torch.nn.ModuleDict({"txt_in": torch.nn.Linear(16, 2)})
    with pytest.raises(ValueError, match=r"dataset: its captions' embeddings are 8 wide, and this SDXL model takes "
                                         r"16: .*Cache Text Embeddings' clip"):
        queued(wide, datasets["image"])

    # the trainer, on the manifests the node writes
    from ingraph_trainer.trainer.data.dataset_checks import check_dataset_for_family
    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    from ingraph_trainer.trainer.models.base import UnsupportedSetting
    image, clip = (load_cached_dataset(str(write_manifest(tmp_path / f"{name}.json", datasets[name],
                                                          tmp_path / "cache"))) for name in ("image", "clip"))
    check_dataset_for_family(image, Family())
    check_dataset_for_family(clip, video)
    for family, dataset, refused in ((flux, image, "its latents have 4 channels"),
                                     (Family(), clip, "its latents are a video VAE's"),
                                     (video, image, "its latents are an image VAE's"),
                                     (wide, image, "its captions' embeddings are 8 wide")):
        with pytest.raises(UnsupportedSetting, match=f"^data.manifest: {re.escape(refused)}"):
            check_dataset_for_family(dataset, family)


def test_captions_whose_pooled_vector_the_model_cannot_take_are_refused(tmp_path):
    """Flux's T5 and CLIP-L captions for an SD3 model: the same 4096-wide embeddings, pooled vectors of 768 for its
    2048, which failed in its y_embedder at the first step. The pooled vector's width is read from the first item's
    text shard, by the trainer (data.manifest) and by the node at queue time (the graph's dataset in its cache). One
    as wide passes, and so do captions without one (the model then takes none). A wider one is refused for SD3,
    whose model takes it whole, and passes for Flux and HunyuanVideo, whose models read its first part, as
    ComfyUI's sampler gives it; a narrower one is refused for all."""
    from types import SimpleNamespace

    from ingraph_trainer.cache.shards import shard_shapes
    from ingraph_trainer.trainer.data.dataset_checks import check_dataset_for_family
    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    from ingraph_trainer.trainer.models.base import UnsupportedSetting
    from ingraph_trainer.trainer.models.flux import FluxFamily
    from ingraph_trainer.trainer.models.hunyuan_video import HunyuanVideoFamily
    from ingraph_trainer.trainer.models.sd3 import SD3Family

    class PooledClip(SyntheticClip):
        def get_sd(self):  # another text encoder: its captions' cache keys are its own
            return {"w": torch.ones(2)}

        def encode_from_tokens(self, text, return_pooled=True, return_dict=True):
            return {**super().encode_from_tokens(text), "pooled_output": torch.ones(1, 4)}

    def taking(real, pooled: int):  # the family's rules, on a model whose pooled layer has its model's name
        layer = torch.nn.Linear(pooled, 2)
        takes_pooled = ({"y_embedder": torch.nn.ModuleDict({"mlp": torch.nn.Sequential(layer)})} if real is SD3Family
                        else {"vector_in": torch.nn.ModuleDict({"in_layer": layer})})
        return SimpleNamespace(
            display_name=real.display_name, latent_channels=4, latent_ndim=4, reference_input=None,
            text_input_layer=r"^txt$", pooled_input_layer=real.pooled_input_layer,
            pooled_read_in_part=real.pooled_read_in_part,
            diffusion_model=torch.nn.ModuleDict({"txt": torch.nn.Linear(8, 2), **takes_pooled}))
    store = CacheStore(tmp_path / "cache")
    (tmp_path / "images").mkdir()
    write_image(tmp_path / "images" / "cat.png")
    dataset, _, _ = cached(tmp_path / "images", store, ImageVAE())
    graph = {name: encode_text(dataset, clip, store)[0] for name, clip in (("pooled", PooledClip()),
                                                                          ("none", SyntheticClip()))}
    store.close()
    for name, part in graph.items():
        manifest = load_cached_dataset(str(write_manifest(tmp_path / f"{name}.json", part, tmp_path / "cache")))
        shapes = shard_shapes(tmp_path / "cache", "text", part.items[0].text)
        assert ("pooled" in shapes) == (name == "pooled"), shapes  # what the captions carry
        for dataset, where, root in ((manifest, "data.manifest", None), (part, "dataset", tmp_path / "cache")):
            for real in (SD3Family, FluxFamily, HunyuanVideoFamily):
                check_dataset_for_family(dataset, taking(real, 4), where, cache_root=root)
                # 6: narrower than the model takes; 2: wider (read in part by Flux's and HunyuanVideo's models)
                refused = set() if name == "none" else {6, 2} if real is SD3Family else {6}
                for pooled in (6, 2):
                    if pooled not in refused:
                        check_dataset_for_family(dataset, taking(real, pooled), where, cache_root=root)
                        continue
                    with pytest.raises(UnsupportedSetting, match=f"^{where}: its captions' pooled vectors are 4 wide, "
                                       f"and this {real.display_name} model takes {pooled}: .*Cache Text Embeddings'"):
                        check_dataset_for_family(dataset, taking(real, pooled), where, cache_root=root)


# --- through the graph ----------------------------------------------------------------------------------------

@pytest.mark.comfyui
def test_dataset_node_appends_the_video_inputs_last_with_tooltips():
    import importlib
    import sys
    from conftest import comfyui_path
    sys.path.insert(0, str(comfyui_path()))
    node = importlib.import_module("ingraph_trainer.nodes.dataset_node")
    inputs = node.LoadTrainingImages.define_schema().inputs
    assert [i.id for i in inputs][-4:] == ["frame_buckets", "fps", "clip_mode", "reference_folder"]
    assert all(i.optional and len(i.tooltip) > 40 for i in inputs[-4:])


VIDEO_FOLDER = "ingraph_video"
WAN_TINY_MODELS = dict(families={"wan": "fp32"}, wan_vae="tiny_wan_vae.safetensors")  # conftest.tiny_models


@pytest.mark.comfyui
@pytest.mark.tiny_models(**WAN_TINY_MODELS)
def test_wan_trains_on_clips_and_an_image_through_the_graph(comfy, client, tools):
    """A 17-frame clip, a 6-frame clip and two images, frame buckets 1 and 17: Cache Latents encodes the long clip
    with ComfyUI's own Wan VAE into a 5-latent-frame video latent (the short one becomes a 1-frame item beside the
    images), Wan trains 2 steps, one per bucket, the events naming both, and the stock text-to-video graph
    (EmptyHunyuanLatentVideo, KSampler) with the LoRA gives another video than without it."""
    from conftest import tiny_models
    from ingraph_trainer.trainer.data.loading import load_cached_dataset

    tiny_models(tools, comfy, **WAN_TINY_MODELS)  # once a session, whichever module needs them first
    folder = comfy.dir("input", VIDEO_FOLDER)
    write_video(folder / "walk.mp4", 17, fps=8)
    write_video(folder / "turn.mp4", 6, fps=8)
    write_image(folder / "still.png")
    write_image(folder / "pose.png", level=30)
    for stem in ("walk", "turn", "still", "pose"):
        (folder / f"{stem}.txt").write_text(f"a {stem}, ingraph style")

    graph = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_wan_vae.safetensors"}},
        "3": {"class_type": "InGraphTestSyntheticTextEncoder", "inputs": {"family": "wan"}},
        "4": {"class_type": "InGraphLoadTrainingImages",
              "inputs": {"folder": VIDEO_FOLDER, "resolution": SIDE, "bucketing": False, "min_side": 64,
                         "max_side": 256, "max_upscale": 1.0, "crop": "center", "flip": False, "repeats": 1,
                         "caption_prefix": "", "missing_caption": "error", "default_caption": "",
                         "frame_buckets": "1, 17", "fps": 8.0}},
        "5": {"class_type": "InGraphCacheLatents", "inputs": {"dataset": ["4", 0], "vae": ["2", 0]}},
        "6": {"class_type": "InGraphCacheTextEmbeddings", "inputs": {"dataset": ["5", 0], "clip": ["3", 0]}},
        "7": {"class_type": "InGraphLoRAAdapter",
              "inputs": {"kind": "LoRA", "rank": 4, "alpha": 4.0, "dropout": 0.0, "targets": "attention"}},
        "8": {"class_type": "InGraphTrainLoRA",
              "inputs": {"model": ["1", 0], "dataset": ["6", 0], "adapter": ["7", 0], "steps": 2, "batch_size": 3,
                         "gradient_accumulation": 1, "learning_rate": 1e-3, "optimizer": "AdamW",
                         "lr_schedule": "constant", "warmup_steps": 0, "precision": "fp32",
                         "gradient_checkpointing": False, "seed": 0, "save_every": 0, "output_name": "wan_video",
                         "resume": "off", "eval_quantiles": SUITE_EVAL_QUANTILES}},
    }
    # batch 3: one batch per bucket (the 17-frame bucket's one item repeated), so the 2 steps of the epoch see both
    outcome = client.run(graph, timeout=900)
    assert outcome.ok, outcome.error
    events = [m["data"]["event"] for m in outcome.messages if m.get("type") == "ingraph.event"]
    started = next(e for e in events if e["type"] == "started")
    steps = [e for e in events if e["type"] == "step"]
    assert started["family"] == "wan" and len(steps) == 2
    assert all(len(e["buckets"]) == 1 and np.isfinite(e["loss"]) for e in steps)
    assert sorted(tuple(e["buckets"][0]) for e in steps) == [(SIDE, SIDE), (SIDE, SIDE, 17)]

    manifest = Path(started["run_dir"]) / "dataset.json"
    dataset = load_cached_dataset(str(manifest))
    shapes = {Path(dataset.sources[i]).name: tuple(dataset.latent(i).shape) for i in range(len(dataset))}
    image = (16, 1, SIDE // 8, SIDE // 8)
    assert shapes == {"walk.mp4": (16, 5, SIDE // 8, SIDE // 8), "turn.mp4": image, "still.png": image,
                      "pose.png": image}

    def sample(lora: str | None, prefix: str):
        graph = {
            "1": {"class_type": "UNETLoader",
                  "inputs": {"unet_name": "tiny_wan.safetensors", "weight_dtype": "default"}},
            "3": {"class_type": "InGraphTestSyntheticTextEncoder", "inputs": {"family": "wan"}},
            "10": {"class_type": "CLIPTextEncode", "inputs": {"text": "a walk, ingraph style", "clip": ["3", 0]}},
            "11": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["3", 0]}},
            "12": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": SIDE, "height": SIDE, "length": 17,
                                                                       "batch_size": 1}},
            "13": {"class_type": "KSampler", "inputs": {"model": ["9", 0] if lora else ["1", 0], "positive": ["10", 0],
                                                        "negative": ["11", 0], "latent_image": ["12", 0], "seed": 1,
                                                        "steps": 2, "cfg": 2.0, "sampler_name": "euler",
                                                        "scheduler": "simple", "denoise": 1.0}},
            "14": {"class_type": "SaveLatent",
                   "inputs": {"samples": ["13", 0], "filename_prefix": f"latents/{prefix}"}},
        }
        if lora:
            graph["9"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora,
                                                                          "strength_model": 1.0}}
        log_before = len(comfy.log_text())
        assert client.run(graph, timeout=300).ok
        assert "lora key not loaded" not in comfy.log_text()[log_before:]
        (saved,) = sorted((comfy.base_dir / "output" / "latents").glob(f"{prefix}_*.latent"))
        return load_file(str(saved))["latent_tensor"]
    base, trained = sample(None, "wan_video_base"), sample("wan_video.safetensors", "wan_video_lora")
    assert base.shape == trained.shape == (1, 16, 5, SIDE // 8, SIDE // 8)
    assert (base - trained).abs().max() > 1e-6, "the LoRA did not change the video"


def test_a_clip_whose_timestamps_claim_more_frames_than_it_holds_is_refused(tmp_path):
    """Issue 28, finding 6: 2 frames 100,000 s apart became 1,600,001 items at 16 fps (0.5 GB of ComfyUI's memory
    in 7 s; a longer gap, every client loses the server). Items come from the frames the file holds."""
    import av
    with av.open(str(tmp_path / "bomb.mp4"), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width = stream.height = SIDE
        stream.pix_fmt = "yuv420p"
        for pts in (0, 8 * 100_000):
            frame = av.VideoFrame.from_ndarray(np.zeros((SIDE, SIDE, 3), dtype=np.uint8), format="rgb24")
            frame.pts = pts
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    assert len(probe_clip(tmp_path / "bomb.mp4").times) == 2 and (tmp_path / "bomb.mp4").stat().st_size < 4096
    with pytest.raises(DatasetError, match=r"bomb.mp4: its timestamps span \d{7} frames at 16 fps, but it holds 2"):
        scan(tmp_path, frame_buckets="1", fps=16)
    # an honest slow clip (2 fps shown at 16 fps: each frame 8 times) still trains
    (tmp_path / "bomb.mp4").unlink()
    write_video(tmp_path / "slow.mp4", frames=4, fps=2)
    assert scan(tmp_path, frame_buckets="1, 17", fps=16).items


def test_a_clips_frames_are_held_to_the_image_pixel_limit(tmp_path, monkeypatch):
    """Issue 28, finding 8: PIL refuses a 14000x14000 PNG, but clip decoding skipped that limit (a 292 kB GIF of
    such frames took 3 GB). The limit lowered here to this test's 64x64 frames."""
    from PIL import Image
    write_video(tmp_path / "big.gif", frames=3, codec="gif")
    assert scan(tmp_path, frame_buckets="1").items
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", SIDE * SIDE - 1)
    with pytest.raises(DatasetError, match=r"big.gif: its 64x64 frames exceed the 4095-pixel limit"):
        scan(tmp_path, frame_buckets="1")
