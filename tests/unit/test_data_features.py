"""Data-side training features: caption dropout, tag-shuffled caption variants, masked loss, prior images.

Unit tier: the pack's caching code runs with small stand-in encoders, and the trainer-side draws, batches and
losses are the functions the training loop calls (no server, no trainer launch).
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from conftest import REPO  # noqa: F401  (conftest registers the pack as the package ingraph_trainer)

buckets_mod = importlib.import_module("ingraph_trainer.cache.buckets")
captions_mod = importlib.import_module("ingraph_trainer.cache.captions")
dataset_mod = importlib.import_module("ingraph_trainer.cache.dataset")
folder_scan_mod = importlib.import_module("ingraph_trainer.cache.folder_scan")
pixels_mod = importlib.import_module("ingraph_trainer.cache.pixels")
encoding = importlib.import_module("ingraph_trainer.cache.encoding")
shards_mod = importlib.import_module("ingraph_trainer.cache.shards")
store_mod = importlib.import_module("ingraph_trainer.cache.store")
data = importlib.import_module("ingraph_trainer.trainer.data.loading")
mix = importlib.import_module("ingraph_trainer.trainer.data.batch_mix")
dataset_checks = importlib.import_module("ingraph_trainer.trainer.data.dataset_checks")
objectives = importlib.import_module("ingraph_trainer.trainer.objectives")
config = importlib.import_module("ingraph_trainer.trainer.spec")


class AreaVAE:
    """Stand-in VAE: the latent is the image's grey value averaged over 8x8 patches (4 channels alike), so a
    latent shows where the image's bright pixels went after bucket, crop and flip."""

    def get_sd(self):
        return {"w": torch.zeros(4)}

    def encode(self, pixels):
        grey = pixels.permute(0, 3, 1, 2).mean(1, keepdim=True)
        return torch.nn.functional.avg_pool2d(grey, 8).repeat(1, 4, 1, 1)


class TextCLIP:
    """Stand-in text encoder: every text gets a distinct, recognisable embedding; counts its encodes."""

    def __init__(self):
        self.encoded = []

    def get_sd(self):
        return {"w": torch.ones(4)}

    def tokenize(self, text):
        return text

    def encode_from_tokens(self, text, return_pooled=True, return_dict=True):
        self.encoded.append(text)
        v = float(int.from_bytes(text.encode()[:6].ljust(6, b"\0"), "big") % 100003) + len(text)
        return {"cond": torch.full((1, 3, 4), v), "pooled_output": torch.full((1, 4), v)}


def write_pair(folder, name, caption, size=(96, 64), left_white_fraction=None, mask_band=None, alpha_band=None):
    """An image (grey, or white in a left band) with its caption, and optionally a mask file white in a band
    (x0, x1) of the image, or the band as the image's opaque part."""
    from PIL import Image
    w, h = size
    img = Image.new("RGBA" if alpha_band else "RGB", size, (0, 0, 0, 0) if alpha_band else (0, 0, 0))
    band = mask_band or alpha_band
    if band:
        img.paste((255, 255, 255, 255) if alpha_band else (255, 255, 255), (band[0], 0, band[1], h))
    img.save(folder / f"{name}.png")
    (folder / f"{name}.txt").write_text(caption)
    if mask_band:
        mask = Image.new("L", size, 0)
        mask.paste(255, (mask_band[0], 0, mask_band[1], h))
        mask.save(folder / f"{name}.mask.png")


# --- caption dropout and tag shuffling -------------------------------------------------------------------------

def test_caption_dropout_rate_and_draws_identical_on_one_and_two_processes():
    """Rate 0.3 gives 30 % +- 5 % empty captions over 1,000 draws, and the per-rank slices the loop takes on
    1 process (accumulation 2) and on 2 processes put the same draw in every slot of every step."""
    seed, batch_size, steps = 7, 2, 250
    global_batch = 4  # 1 process x 2 micro-batches, or 2 processes x 1
    layouts = {1: dict(grad_accum=2, world=1), 2: dict(grad_accum=1, world=2)}
    empties = 0
    for step in range(steps):
        whole = mix.text_draw(seed, step, global_batch, 0.3)
        empties += int(whole.empty.sum())
        for layout in layouts.values():
            seen_empty, seen_pick = [None] * global_batch, [None] * global_batch
            for rank in range(layout["world"]):
                # each rank draws on its own, as it will in its own process, and keeps its slots
                mine = mix.text_draw(seed, step, global_batch, 0.3)
                for slots in mix.micro_batch_slots(batch_size, layout["grad_accum"], layout["world"], rank):
                    part = mine[slots]
                    for k, slot in enumerate(range(slots.start, slots.stop)):
                        seen_empty[slot], seen_pick[slot] = bool(part.empty[k]), float(part.pick[k])
            assert seen_empty == whole.empty.tolist() and seen_pick == whole.pick.tolist()
    draws = steps * global_batch
    assert draws == 1000
    print(f"caption dropout 0.3: {empties} of {draws} draws empty ({empties / draws:.1%})")
    assert 0.25 <= empties / draws <= 0.35
    assert mix.text_draw(8, 0, 64, 0.3).empty.tolist() != mix.text_draw(7, 0, 64, 0.3).empty.tolist()
    assert not mix.text_draw(seed, 3, 64, 0.0).empty.any()


def test_micro_batch_slots_cover_the_global_batch_once_on_any_layout():
    for world, accum in ((1, 4), (2, 2), (4, 1)):
        slots = [s for rank in range(world) for s in mix.micro_batch_slots(3, accum, world, rank)]
        assert sorted(i for s in slots for i in range(s.start, s.stop)) == list(range(12))


def test_tag_shuffling_keeps_leading_tags_and_is_the_same_on_every_run():
    caption = "ohwx, a red square, studio light, high detail, blue background"
    variants = captions_mod.caption_variants_of(caption, 6, keep_tags=1)
    assert variants == captions_mod.caption_variants_of(caption, 6, keep_tags=1)  # deterministic
    assert all(v.startswith("ohwx, ") for v in variants)
    assert all(sorted(v.split(", ")) == sorted(caption.split(", ")) for v in variants)
    assert len(set(variants)) > 1
    two_kept = captions_mod.caption_variants_of(caption, 6, keep_tags=2)
    assert all(v.startswith("ohwx, a red square, ") for v in two_kept)
    assert captions_mod.shuffled_caption("solo", 3, keep_tags=0) == "solo"


def cached_run(tmp_path, *, caption_dropout=0.0, caption_variants=0, masks="mask files", clip=None, vae=None,
               folder="images", **scan):
    """Scans and caches the folder as the cache nodes do, writes a run manifest and loads it as the trainer
    does: (TrainingDataset, CachedDataset, store root, text counts)."""
    root = tmp_path / "cache"
    store = store_mod.CacheStore(root)
    try:
        ds = folder_scan_mod.scan_image_folder(tmp_path / folder, resolution=64, caption_dropout=caption_dropout,
                                           caption_variants=caption_variants, masks=masks, **scan)
        ds, *_ = encoding.encode_latents(ds, vae or AreaVAE(), store)
        ds, encoded, reused = encoding.encode_text(ds, clip or TextCLIP(), store)
        encoding.record_usage(ds, store)
    finally:
        store.close()
    (tmp_path / "run").mkdir(exist_ok=True)
    manifest = store_mod.write_manifest(tmp_path / "run" / f"{folder}.json", ds, root)
    return ds, data.load_cached_dataset(str(manifest)), root, (encoded, reused)


def test_variants_and_the_empty_caption_are_cached_once_and_drawn_by_the_trainer(tmp_path):
    (tmp_path / "images").mkdir()
    write_pair(tmp_path / "images", "a", "ohwx, red, square, shiny, big")
    write_pair(tmp_path / "images", "b", "ohwx, blue, circle, matte, small")
    clip = TextCLIP()
    ds, cached, root, (encoded, _) = cached_run(tmp_path, caption_dropout=0.3, caption_variants=4, keep_tags=1,
                                                clip=clip)
    assert clip.encoded.count("") == 1 and ds.empty_text and cached.empty_text == ds.empty_text
    assert all(len(item.text_variants) == 4 for item in ds.items) and encoded == len(clip.encoded)
    assert all(len(v) == 4 for v in cached.text_variants)
    # the manifest alone pins every text entry the trainer may draw: none is pruned while the run exists
    store = store_mod.CacheStore(root)
    assert store.prune(older_than_s=0)["removed"] == 0  # recorded as the dataset's too (record_usage)
    store.set_dataset(ds.usage_identity("text", ds.text_encoder), ds.folder, [])
    assert store.prune(older_than_s=0)["removed"] == 0
    store.close()
    again = TextCLIP()
    _, _, _, (encoded2, reused2) = cached_run(tmp_path, caption_dropout=0.3, caption_variants=4, keep_tags=1,
                                              clip=again)
    assert encoded2 == 0 and reused2 == encoded and again.encoded == []  # nothing is encoded twice

    def value(text):
        return TextCLIP().encode_from_tokens(text)["cond"][0, 0, 0].item()
    empty_value = value("")
    draw = mix.text_draw(3, 0, 64, 0.3)
    indices = [n % 2 for n in range(64)]
    batch = mix.training_batch(cached, indices, draw)
    for n, i in enumerate(indices):
        got = batch.cond[n, 0, 0].item()
        if draw.empty[n]:
            assert got == empty_value
        else:
            variants = captions_mod.caption_variants_of(ds.items[i].caption, 4, keep_tags=1)
            assert got == value(variants[int(float(draw.pick[n]) * 4)])
    assert batch.mask is None
    # no draw: the captions as written, exactly CachedDataset.batch (what evaluation and a plain run see)
    plain = mix.training_batch(cached, [0, 1])
    latents, cond, pooled = cached.batch([0, 1])
    assert torch.equal(plain.latents, latents) and torch.equal(plain.cond, cond) and torch.equal(plain.pooled, pooled)
    # a spec that turns shuffling off sees the captions as written
    off = mix.training_batch(cached, [0, 1], mix.text_draw(3, 0, 2, 0.0), shuffle_tags=False)
    assert torch.equal(off.cond, cond)


def test_caption_dropout_without_a_cached_empty_caption_fails_at_start(tmp_path):
    (tmp_path / "images").mkdir()
    write_pair(tmp_path / "images", "a", "a cat")
    clip = TextCLIP()
    ds, cached, root, (encoded, _) = cached_run(tmp_path, clip=clip)
    # the empty caption is cached without dropout too (Distill's guidance needs it), not counted as a caption
    assert clip.encoded.count("") == 1 and cached.empty_text and encoded == 1
    dataset_checks.check_caption_features(cached, 0.1)
    # a cache written before it always was: dropout is refused at start
    old = store_mod.write_manifest(tmp_path / "run" / "old.json", dataclasses.replace(ds, empty_text=()), root)
    cached = data.load_cached_dataset(str(old))
    assert cached.empty_text is None
    dataset_checks.check_caption_features(cached, 0.0)
    with pytest.raises(ValueError, match="data.caption_dropout: data.manifest has no empty-caption embedding"):
        dataset_checks.check_caption_features(cached, 0.1)


def test_conditionings_of_different_lengths_batch_the_way_comfyui_does():
    short, long = torch.arange(6.).reshape(2, 3), torch.arange(12.).reshape(4, 3) + 100
    stacked = mix.stack_conds([short, long])
    assert stacked.shape == (2, 4, 3) and torch.equal(stacked[0], torch.cat([short, short]))
    # captions of an encoder that does not pad (23 and 31 tokens): ComfyUI would not batch them (over 4 repeats)
    with pytest.raises(ValueError, match=r"train.batch_size: captions in one batch encode to \[23, 31\] tokens"):
        mix.stack_conds([torch.zeros(23, 3), torch.zeros(31, 3)])


# --- masked loss ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mse", "huber"])
def test_a_mask_zeroing_the_right_half_gives_zero_gradient_there(kind):
    torch.manual_seed(0)
    prediction = torch.randn(3, 4, 8, 8, requires_grad=True)
    target = torch.randn(3, 4, 8, 8)
    mask = torch.ones(3, 1, 8, 8)
    mask[..., 4:] = 0.0
    per_sample = objectives.per_sample_loss(prediction, target, kind, 0.1, mask=mask)
    objectives.batch_loss(per_sample, torch.tensor([1.0, 0.5, 1.0])).backward()
    grad = prediction.grad
    assert torch.count_nonzero(grad[..., 4:]) == 0
    assert torch.count_nonzero(grad[..., :4]) == grad[..., :4].numel()
    # the masked loss is the plain loss of the kept half
    kept = objectives.per_sample_loss(prediction[..., :4], target[..., :4], kind, 0.1)
    assert torch.allclose(per_sample, kept)
    # a 5-D (video) layout takes the same mask with a frame axis
    p5 = prediction.detach().unsqueeze(2).requires_grad_()
    objectives.per_sample_loss(p5, target.unsqueeze(2), kind, 0.1, mask=mask.unsqueeze(2)).sum().backward()
    assert torch.count_nonzero(p5.grad[..., 4:]) == 0


def test_no_mask_is_the_loss_as_before():
    prediction, target = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    plain = objectives.per_sample_loss(prediction, target)
    assert torch.equal(plain, (prediction - target).pow(2).mean(dim=(1, 2, 3)))
    assert torch.equal(objectives.batch_loss(plain), plain.mean())
    fully_masked = objectives.per_sample_loss(prediction, target, mask=torch.zeros(2, 1, 8, 8))
    assert torch.equal(fully_masked, torch.zeros(2))


def latent_grey(batch, n):
    return batch.latents[n, 0]


@pytest.mark.parametrize("crop", ["center", "random"])
def test_a_cached_mask_follows_its_images_bucket_crop_and_flip(tmp_path, crop):
    """The image is white exactly where its mask is white, so the cached latent (the image's area average)
    and the cached mask must agree cell by cell, flipped items included."""
    (tmp_path / "images").mkdir()
    write_pair(tmp_path / "images", "wide", "a", size=(320, 128), mask_band=(20, 100))
    write_pair(tmp_path / "images", "tall", "b", size=(128, 300), mask_band=(70, 128))
    ds, cached, _, _ = cached_run(tmp_path, buckets=buckets_mod.BucketSettings(
        resolution=128, enabled=True, min_side=64, max_side=256, crop=crop, flip=True))
    assert all(item.mask_source.endswith(".mask.png") for item in ds.items) and all(cached.masked)
    assert {item.bucket for item in ds.items} == {(192, 64), (64, 192)}  # both resized and cropped
    for n in range(len(cached)):
        b = mix.training_batch(cached, [n])
        assert b.mask.shape == (1, 1) + b.latents.shape[-2:]
        diff = (b.mask[0, 0] - b.latents[0, 0]).abs().max().item()
        assert diff < 0.1, f"{ds.items[n].path} flip={ds.items[n].flip}: mask and latent differ by {diff}"
        assert b.mask.max() > 0.9 and b.mask.min() < 0.1
    # flipped and unflipped items of one image carry mirrored masks
    first, mirrored = mix.training_batch(cached, [0]).mask, mix.training_batch(cached, [1]).mask
    assert ds.items[1].flip and torch.allclose(first.flip(-1), mirrored)


def test_alpha_channel_masks_and_unmasked_items_weigh_one(tmp_path):
    (tmp_path / "images").mkdir()
    write_pair(tmp_path / "images", "cut", "a", size=(64, 64), alpha_band=(0, 32))
    write_pair(tmp_path / "images", "plain", "b", size=(64, 64))
    ds, cached, _, _ = cached_run(tmp_path, masks="alpha channel")
    assert [i.mask_source for i in ds.items] == ["alpha", ""] and cached.masked == [True, False]
    batch = mix.training_batch(cached, [0, 1])
    assert batch.mask.shape == (2, 1, 8, 8)
    assert torch.all(batch.mask[0, 0, :, :4] == 1) and torch.all(batch.mask[0, 0, :, 4:] == 0)
    assert torch.all(batch.mask[1] == 1)
    assert mix.training_batch(cached, [0, 1], masked_loss=False).mask is None


def test_a_changed_mask_re_encodes_only_its_item_and_mask_files_are_not_images(tmp_path):
    from PIL import Image
    (tmp_path / "images").mkdir()
    for n in range(3):
        write_pair(tmp_path / "images", f"i{n}", "x", size=(64, 64), mask_band=(0, 16 * (n + 1)))
    write_pair(tmp_path / "images", "free", "y", size=(64, 64))
    root = tmp_path / "cache"

    def run():
        store = store_mod.CacheStore(root)
        try:
            ds = folder_scan_mod.scan_image_folder(tmp_path / "images", resolution=64)
            return encoding.encode_latents(ds, AreaVAE(), store)
        finally:
            store.close()
    ds, encoded, reused = run()
    assert len(ds.items) == 4 and (encoded, reused) == (4, 0)
    assert not any(".mask" in item.path for item in ds.items)
    Image.new("L", (64, 64), 255).save(tmp_path / "images" / "i1.mask.png")
    ds2, encoded, reused = run()
    assert (encoded, reused) == (1, 3)
    changed = [a.path for a, b in zip(ds.items, ds2.items, strict=True) if a.latent != b.latent]
    assert changed == [str(tmp_path / "images" / "i1.png")]
    # an unmasked item's key is the one it had before masks existed
    store = store_mod.CacheStore(root)
    item = next(i for i in ds2.items if not i.mask_source)
    assert item.latent == shards_mod.content_key(
        kind="latent", format=encoding.LATENT_FORMAT, source=store.source_digest(item.path), bucket=[64, 64],
        crop="center", flip=False, encoder=encoding.vae_identity(AreaVAE()))
    store.close()
    # masks off: the same images train unmasked (their latents are keyed without a mask)
    off = folder_scan_mod.scan_image_folder(tmp_path / "images", resolution=64, masks="off")
    assert not any(item.mask_source for item in off.items)


def test_mask_files_are_checked_against_their_image(tmp_path):
    from PIL import Image
    write_pair(tmp_path, "a", "x", size=(64, 64))
    Image.new("L", (32, 32), 255).save(tmp_path / "a.mask.png")
    with pytest.raises(pixels_mod.DatasetError, match=r"mask .*a\.mask\.png is 32x32 but its image a\.png is 64x64"):
        folder_scan_mod.scan_image_folder(tmp_path, resolution=64)
    Image.new("L", (64, 64), 255).save(tmp_path / "a.mask.png")
    Image.new("L", (64, 64), 255).save(tmp_path / "a.mask.webp")
    with pytest.raises(pixels_mod.DatasetError, match="has two mask files"):
        folder_scan_mod.scan_image_folder(tmp_path, resolution=64)


# --- prior images --------------------------------------------------------------------------------------------

def test_prior_images_at_weight_half_fill_their_share_of_every_batch():
    main_buckets = [(64, 64)] * 10 + [(96, 64)] * 6
    prior_buckets = [(64, 64)] * 5 + [(96, 64)] * 3
    seed, global_batch, weight = 3, 8, 0.5
    sampler = mix.PriorMixSampler(main_buckets, prior_buckets, global_batch, seed, prior_fraction=0.25)
    combined = main_buckets + prior_buckets
    assert sampler.prior_slots == 2 and sampler.uncovered_buckets() == []
    seen_main, seen_prior, slot_counts = set(), set(), torch.zeros(global_batch)
    for step in range(400):
        indices = sampler.indices(step)
        assert indices == sampler.indices(step) and len(indices) == global_batch
        assert len({combined[i] for i in indices}) == 1  # one bucket per batch, prior items included
        is_prior = sampler.is_prior(indices)
        assert int(is_prior.sum()) == 2
        weights = mix.sample_weights(is_prior, weight)
        assert weights.tolist() == [weight if p else 1.0 for p in is_prior.tolist()]
        slot_counts += is_prior.float()
        seen_main |= {i for i in indices if i < 16}
        seen_prior |= {i for i in indices if i >= 16}
    assert seen_main == set(range(16)) and seen_prior == set(range(16, 24))
    assert slot_counts.min() > 0  # prior items land on every slot, so on every rank and micro-batch
    # each epoch of the training set still shows every training item
    epoch = [i for step in range(sampler.batches_per_epoch) for i in sampler.indices(step) if i < 16]
    assert set(epoch) == set(range(16))
    noise, timesteps = sampler.noise_and_timesteps(5, (4, 8, 8))
    assert noise.shape == (8, 4, 8, 8) and timesteps.shape == (8,)


def test_a_bucket_without_prior_items_keeps_its_batches_full_of_training_items():
    main_buckets = [(64, 64)] * 4 + [(128, 64)] * 4
    sampler = mix.PriorMixSampler(main_buckets, [(64, 64)] * 3, 4, 0, prior_fraction=0.5)
    assert sampler.uncovered_buckets() == [(128, 64)]
    for step in range(50):
        indices = sampler.indices(step)
        bucket = {(main_buckets + [(64, 64)] * 3)[i] for i in indices}
        assert len(bucket) == 1
        assert int(sampler.is_prior(indices).sum()) == (2 if bucket == {(64, 64)} else 0)


def test_prior_share_must_leave_room_for_both_sets():
    with pytest.raises(ValueError, match="data.prior_fraction: 0.1 of a global batch of 4 gives 0 prior slots"):
        mix.prior_slot_count(4, 0.1)
    with pytest.raises(ValueError, match="data.prior_fraction"):
        mix.prior_slot_count(1, 0.5)
    assert mix.prior_slot_count(4, 0.5) == 2


def test_prior_and_training_losses_are_reported_apart():
    per_sample = torch.tensor([1.0, 2.0, 3.0, 5.0])
    is_prior = torch.tensor([False, True, False, True])
    parts = mix.loss_parts(per_sample, is_prior) + mix.loss_parts(torch.tensor([4.0]), torch.tensor([False]))
    assert mix.split_losses(parts) == {"main_loss": (1 + 3 + 4) / 3, "prior_loss": (2 + 5) / 2}
    assert mix.split_losses(mix.loss_parts(per_sample[:1], is_prior[:1]))["prior_loss"] is None
    weighted = objectives.batch_loss(per_sample, mix.sample_weights(is_prior, 0.5))
    assert weighted.item() == pytest.approx((1 + 1 + 3 + 2.5) / 4)


def test_a_mixed_dataset_batches_training_and_prior_items_from_their_own_caches(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "prior").mkdir()
    write_pair(tmp_path / "images", "a", "ohwx dog")
    write_pair(tmp_path / "prior", "p", "a dog", mask_band=(0, 48))
    main_ds, main, _, _ = cached_run(tmp_path, caption_dropout=0.5)
    prior_ds, prior, _, _ = cached_run(tmp_path, folder="prior", caption_dropout=0.5)
    assert dataset_mod.prior_problems(main_ds, prior_ds) == []
    assert dataset_mod.prior_problems(main_ds, dataclasses_replace(prior_ds, latent_encoder="other"))
    mixed = mix.MixedDataset(main, prior)
    dataset_checks.check_caption_features(mixed, 0.5)
    assert len(mixed) == 2 and mixed.unique == main.unique
    batch = mix.training_batch(mixed, [0, 1], mix.text_draw(0, 0, 2, 0.0))
    assert batch.mask is not None and torch.all(batch.mask[0] == 1)  # the training image has no mask
    assert batch.cond[0, 0, 0] != batch.cond[1, 0, 0]


def dataclasses_replace(obj, **changes):
    import dataclasses
    return dataclasses.replace(obj, **changes)


# --- the spec ------------------------------------------------------------------------------------------------

def base_spec(**data):
    return {"run_dir": "/tmp/r", "model": {"path": "/m.safetensors"}, "data": {"manifest": "/d.json", **data},
            "output": {"lora_path": "/l.safetensors"}}


def test_data_features_are_spec_fields_with_errors_that_name_them():
    spec = config.spec_from_dict(base_spec(caption_dropout=0.1, shuffle_tags=False, masked_loss=False,
                                           prior_manifest="/p.json", prior_weight=0.5, prior_fraction=0.25))
    d = spec.data
    assert (d.caption_dropout, d.shuffle_tags, d.masked_loss, d.prior_manifest, d.prior_weight, d.prior_fraction) \
        == (0.1, False, False, "/p.json", 0.5, 0.25)
    assert config.parse_run_spec(config.dump_run_spec(spec).encode(), "run.toml").data == d
    for field, value, needle in (("caption_dropout", 1.0, "data.caption_dropout: must be in [0, 1)"),
                                 ("prior_weight", -1.0, "data.prior_weight: must be 0 or more"),
                                 ("prior_fraction", 1.0, "data.prior_fraction: must be in (0, 1)"),
                                 ("prior_manifest", "/d.json", "data.prior_manifest: is the training manifest")):
        with pytest.raises(config.RunSpecError, match=needle.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[")):
            config.spec_from_dict(base_spec(**{field: value}))


@pytest.mark.comfyui
def test_dataset_node_appends_the_new_inputs_last_with_tooltips():
    import sys
    from conftest import comfyui_path
    sys.path.insert(0, str(comfyui_path()))
    node = importlib.import_module("ingraph_trainer.nodes.dataset_node")
    inputs = node.LoadTrainingImages.define_schema().inputs
    names = [i.id for i in inputs]
    start = names.index("transparent_background")  # later inputs (video datasets) come after these
    assert names[start:start + 5] == ["transparent_background", "masks", "caption_dropout", "caption_variants",
                                      "keep_tags"]
    for i in inputs[-4:]:
        assert i.optional and i.tooltip and len(i.tooltip) > 20


# --- the step the loop loads ---------------------------------------------------------------------------------

def step_by_slot(dataset, sampler, spec_data, step, batch_size, grad_accum, world):
    """Every rank's micro-batches of a step put back in global-batch slot order, as a dict of tensors."""
    slots = {}
    for rank in range(world):
        _, micro, _ = mix.load_step(dataset, sampler, step, spec_data, 5, batch_size, grad_accum, world, rank)
        for s, mb in zip(mix.micro_batch_slots(batch_size, grad_accum, world, rank), micro, strict=True):
            for k, slot in enumerate(range(s.start, s.stop)):
                slots[slot] = {name: (v[k] if v is not None else None) for name, v in mb._asdict().items()}
    return [slots[n] for n in range(len(slots))]


def test_one_and_two_processes_load_the_same_step_with_every_feature_on(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "prior").mkdir()
    for n in range(5):
        write_pair(tmp_path / "images", f"m{n}", f"ohwx, tag{n}, red, big", size=(64, 64), mask_band=(0, 8 * (n + 2)))
    for n in range(3):
        write_pair(tmp_path / "prior", f"p{n}", f"dog, tag{n}, brown", size=(64, 64))
    _, main, _, _ = cached_run(tmp_path, caption_dropout=0.3, caption_variants=3, keep_tags=1)
    _, _, _, _ = cached_run(tmp_path, folder="prior", caption_dropout=0.3, caption_variants=3)
    spec = config.DataSpec(manifest=str(tmp_path / "run" / "images.json"),
                           prior_manifest=str(tmp_path / "run" / "prior.json"), caption_dropout=0.3,
                           prior_weight=0.5, prior_fraction=0.5)
    dataset, sampler = mix.build_training_data(spec, global_batch=4, seed=5)
    assert isinstance(sampler, mix.PriorMixSampler)
    for step in range(6):
        one = step_by_slot(dataset, sampler, spec, step, 2, 2, 1)
        two = step_by_slot(dataset, sampler, spec, step, 2, 1, 2)
        for a, b in zip(one, two, strict=True):
            assert a.keys() == b.keys()
            for name in a:
                assert (a[name] is None and b[name] is None) or torch.equal(a[name], b[name]), name
        assert sum(bool(slot["is_prior"]) for slot in one) == 2
        assert [slot["sample_weight"].item() for slot in one] == [0.5 if slot["is_prior"] else 1.0 for slot in one]
        # every training item is masked; a prior item beside one weighs 1 everywhere (a micro-batch of prior
        # items alone has no mask at all)
        assert all(slot["mask"] is not None for slot in one if not slot["is_prior"])
        assert all(torch.all(slot["mask"] == 1) for slot in one if slot["is_prior"] and slot["mask"] is not None)
    # a plain spec loads what the loop loaded before these features: CachedDataset.batch and StepSampler's noise
    plain = config.DataSpec(manifest=spec.manifest)
    dataset, sampler = mix.build_training_data(plain, global_batch=4, seed=5)
    assert type(sampler) is data.StepSampler
    indices, micro, timesteps = mix.load_step(dataset, sampler, 3, plain, 5, 2, 2, 1, 0)
    noise, uniform = sampler.noise_and_timesteps(3, tuple(main.batch([0])[0].shape[1:]))
    for m, lo in enumerate((0, 2)):
        latents, cond, pooled = main.batch(indices[lo:lo + 2])
        mb = micro[m]
        assert torch.equal(mb.latents, latents) and torch.equal(mb.cond, cond) and torch.equal(mb.pooled, pooled)
        assert torch.equal(mb.noise, noise[lo:lo + 2]) and torch.equal(mb.timesteps, uniform[lo:lo + 2])
        assert mb.sample_weight is None and mb.is_prior is None and mb.mask is not None
    assert mix.load_step(dataset, sampler, 3, config.DataSpec(manifest=spec.manifest, masked_loss=False), 5, 2, 2,
                         1, 0)[1][0].mask is None


@pytest.mark.comfyui
def test_the_pixel_space_vae_caches_each_image_itself_for_pixel_space_models(tmp_path):
    """Pixel-space models (Chroma Radiance, Z-Image's pixel-space variant) train on Load VAE's "pixel_space" VAE
    (comfy.sd.VAE of the state dict VAELoader gives it): the cache holds each image at full size, 3 channels, scaled
    to -1..1, which is what ComfyUI's VAE Encode hands such a model's sampler; an image VAE with its own identity."""
    from tools.bootstrap import bootstrap
    bootstrap()
    import comfy.sd
    from media_files import write_image
    pixel_space = comfy.sd.VAE(sd={"pixel_space_vae": torch.tensor(1.0)})  # as nodes.VAELoader builds "pixel_space"
    assert not encoding.is_video_vae(pixel_space)
    assert encoding.vae_identity(pixel_space) != encoding.vae_identity(AreaVAE())
    (tmp_path / "images").mkdir()
    write_image(tmp_path / "images" / "a.png", 128, size=(64, 64))
    (tmp_path / "images" / "a.txt").write_text("a flat colour")
    ds, cached, _, _ = cached_run(tmp_path, vae=pixel_space)
    assert ds.latent_encoder == encoding.vae_identity(pixel_space)
    latent = cached.latent(0).float()
    assert latent.shape == (3, 64, 64), latent.shape  # the image's own pixels: no downscale, RGB
    expected = torch.tensor([128, 40, 200]).float().div(255).mul(2).sub(1)  # write_image's colour, in -1..1
    assert torch.allclose(latent, expected.view(3, 1, 1).expand_as(latent), atol=4e-3), latent.mean((1, 2))
