"""Encode a dataset's images (graph's VAE) and captions (graph's CLIP) into the cache, once per item.

A latent's key covers the image bytes, its bucket, crop, flip and the VAE's weights (and, for an item
with a loss mask, the mask's bytes: the mask is stored in the latent's shard, on the latent's grid); a
text embedding's key covers the caption and the text encoder's weights and settings. Tag-shuffled
caption variants and the empty caption (caption dropout) are text entries like any other. Unchanged
items are never encoded again; any change re-encodes exactly what depends on it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from .audio import audio_latent_count, audio_timing_problem, clip_audio_latent, is_audio_vae
from .captions import caption_variants_of
from .dataset import TrainingDataset
from .pixels import ALPHA_MASK, IMAGE_EXTENSIONS, DatasetError, clip_fps, load_clip_item_tensor, load_image_tensor, \
    load_mask_tensor, load_reference_tensor, mask_to_latent_grid, shown
from .shards import content_key, fingerprint_state_dict
from .store import CacheStore
from .video import clip_digest, clip_rotation

LATENT_FORMAT = 2
TEXT_FORMAT = 1
MASK_FORMAT = 1  # how a mask becomes latent-grid weights (mask_to_latent_grid); part of a masked latent's key
# how reference images are encoded (with their target's crop and flip, as_start_image); part of the key of an item
# with them
REFERENCE_FORMAT = 2
# how a clip item's sound becomes its audio latent (cache/audio.py: its span, resampling, the fitted length); part
# of the key of an item cached with an audio VAE
AUDIO_FORMAT = 1

Progress = Callable[[int, int], None]


def vae_identity(vae) -> str:
    return fingerprint_state_dict(vae.get_sd())


def unread_text_weights(clip) -> set[str]:
    """The state-dict keys of a ComfyUI text encoder that no cached output depends on: each CLIP text model's
    (SDClipModel's) `logit_scale`, CLIP's image-text temperature, which no text encoding reads, and its
    `transformer.text_projection.weight` where nothing the encoder returns depends on it. These are the two weights
    ComfyUI lets a CLIP file lack (it warns of no others missing) and then leaves uninitialised, so a key that
    sampled them changed each time the same file was loaded. A projection is unread where its model returns the
    unprojected pooled vector (return_projected_pooled False: SD1.x's CLIP-L, SD3's, Flux's, HunyuanVideo's) or
    where the encoder drops that model's pooled vector (SDXL's CLIP-L), which ComfyUI is asked (projection_is_read).
    A projection that shapes the returned pooled vector (SDXL's CLIP-G, SD2's, HiDream's) stays in the key."""
    model = getattr(clip, "cond_stage_model", None)
    if model is None or not hasattr(model, "named_modules"):
        return set()
    unread = set()
    for name, module in model.named_modules():
        projection = getattr(getattr(module, "transformer", None), "text_projection", None)
        if not hasattr(module, "return_projected_pooled") or projection is None:
            continue  # not a CLIP text model (T5, LLaMA, ... have no such optional weights)
        prefix = f"{name}." if name else ""
        unread.add(f"{prefix}logit_scale")
        if not module.return_projected_pooled or not projection_is_read(clip, name, projection):
            unread.add(f"{prefix}transformer.text_projection.weight")
    return unread


_PROJECTION_READ: dict[tuple[type, str], bool] = {}  # (encoder class, CLIP model's name) -> projection_is_read


def projection_is_read(clip, name: str, projection) -> bool:
    """Whether what the text encoder returns depends on its CLIP model `name`'s text projection: ComfyUI encodes an
    empty caption twice with the projection's output replaced by two different constants (its weights untouched) and
    the outputs are compared. Whether an encoder class reads a model's pooled vector is in its code, not its
    weights, so this is asked once per class and model."""
    import torch
    memo = (type(clip.cond_stage_model), name)
    if memo not in _PROJECTION_READ:
        outputs = []
        for value in (0.5, -0.5):
            handle = projection.register_forward_hook(lambda m, args, out, v=value: torch.full_like(out, v))
            try:
                out = clip.encode_from_tokens(clip.tokenize(""), return_pooled=True, return_dict=True)
            finally:
                handle.remove()
            outputs.append({k: v for k, v in out.items() if isinstance(v, torch.Tensor)})
        first, second = outputs
        _PROJECTION_READ[memo] = first.keys() != second.keys() or any(
            not torch.equal(first[k], second[k]) for k in first)
    return _PROJECTION_READ[memo]


def returns_text_mask(clip) -> bool:
    """Whether the text encoder returns its attention mask beside the embedding (ComfyUI's SDClipModel with
    return_attention_masks: LTX-Video's and Mochi's T5, Lumina 2's Gemma, Qwen-Image's Qwen ...), which ComfyUI's
    CLIPTextEncode puts into the conditioning for the model's extra_conds (LTXV masks the padding tokens with it)."""
    model = getattr(clip, "cond_stage_model", None)
    return model is not None and hasattr(model, "modules") and any(
        getattr(m, "return_attention_masks", False) for m in model.modules())


# Text encoders whose extra outputs (beside the embedding, the pooled vector and the attention mask) the cache keeps,
# as CLIPTextEncode puts them into the conditioning for the model's extra_conds: HunyuanDiT's mT5 embedding and mask,
# Anima's T5 token ids and weights (its LLM adapter's input), HiDream's Llama layers, and the ByT5 glyph embedding
# HunyuanImage 2.1's and HunyuanVideo 1.5's encoder gives a caption with quoted text (and only such a caption). Their
# entries hold them (TEXT_EXTRA), and their identity says so: entries cached before are not reused.
TEXT_EXTRAS_ENCODERS = ("HyditModel", "AnimaTEModel", "HiDreamTEModel", "HunyuanImageTEModel")
TEXT_EXTRA = "extra."  # a text entry's tensor of that name: one of the encoder's extra outputs, as it returned it


def returns_text_extras(clip) -> bool:
    model = getattr(clip, "cond_stage_model", None)
    return any(c.__name__ in TEXT_EXTRAS_ENCODERS for c in type(model).__mro__)


def clip_identity(clip) -> str:
    """What determines a CLIP's text embeddings: the weights its encoding reads (unread_text_weights left out), its
    layer setting (CLIPSetLastLayer) and any LoRA patched onto it."""
    unread = unread_text_weights(clip)
    weights = {k: v for k, v in clip.get_sd().items() if k not in unread}
    ident = {"weights": fingerprint_state_dict(weights), "layer_idx": getattr(clip, "layer_idx", None)}
    if returns_text_mask(clip):  # its entries hold the mask too (entries cached before they did are not reused)
        ident["text_mask"] = True
    if returns_text_extras(clip):
        ident["text_extras"] = True
    patches = getattr(getattr(clip, "patcher", None), "patches", {}) or {}
    if patches:  # a LoRA applied to the text encoder changes every embedding
        ident["patches"] = fingerprint_state_dict(
            {f"{k}/{n}": p[1] for k, plist in patches.items() for n, p in enumerate(plist) if hasattr(p[1], "shape")})
        ident["strengths"] = sorted((k, [float(p[0]) for p in plist]) for k, plist in patches.items())
    return content_key(**ident)[:32]


def latent_key(digest: str, item, dataset: TrainingDataset, encoder: str, mask_digest: str = "",
               reference_digests=(), audio_encoder: str = "") -> str:
    # `pixels` only where decoding is more than a plain 8-bit conversion (16-bit, transparency on a chosen
    # background), `mask` only for a masked item: every other image keeps the key it had before those existed
    extra = {"pixels": item.pixels} if item.pixels else {}
    if item.mask_source:
        extra["mask"] = {"source": mask_digest, "format": MASK_FORMAT}
    if item.is_clip:  # which frames, at which rate; a still image keeps the key it always had
        extra["clip"] = {"start": item.start, "frames": item.frames, "fps": clip_fps(item, dataset.fps)}
        if Path(item.path).is_dir():  # frames may be transparent PNGs, composited on the background colour
            extra["clip"]["background"] = list(dataset.background)
        elif clip_rotation(item.path):  # turned upright when decoded (latents cached before that were sideways)
            extra["clip"]["rotation"] = clip_rotation(item.path)
    if reference_digests:  # a clip's reference is encoded as a start image of its length (as_start_image)
        extra["references"] = {"sources": list(reference_digests), "format": REFERENCE_FORMAT,
                               "background": list(dataset.background)}
    if audio_encoder:  # the clip's sound beside its frames; an item cached without it keeps its key
        extra["audio"] = {"encoder": audio_encoder, "format": AUDIO_FORMAT}
    return content_key(kind="latent", format=LATENT_FORMAT, source=digest, bucket=list(item.bucket),
                       crop=dataset.buckets.crop, flip=item.flip, encoder=encoder, **extra)


def mask_digest(item, store: CacheStore) -> str:
    """What identifies an item's mask: the mask file's bytes, or 'alpha' (the image's bytes are in the key)."""
    if not item.mask_source:
        return ""
    return ALPHA_MASK if item.mask_source == ALPHA_MASK else store.source_digest(item.mask_source)


def text_key(caption: str, encoder: str, image: str = "") -> str:
    """`image`: what identifies the images the encoder read beside the caption (text_image_key); a caption encoded
    alone keeps the key it always had."""
    extra = {"image": image} if image else {}
    return content_key(kind="text", format=TEXT_FORMAT, caption=caption, encoder=encoder, **extra)


# Qwen-Image-Edit 2509 and later are conditioned at inference by TextEncodeQwenImageEditPlus: each source image
# ("Picture N:" in the prompt, at most 3) scaled to about this many pixels, its aspect kept (area resampling), read
# by Qwen2.5-VL beside the prompt
VISION_PIXELS = 384 * 384
MAX_SOURCE_IMAGES = 3
IMAGE_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"
VISION_FORMAT = 1  # how an item's references become the encoder's images (vision_input); part of such a text key


def edit_prompt_template(clip) -> str | None:
    """The template TextEncodeQwenImageEditPlus gives Qwen-Image's text encoder: its tokenizer's template for a
    prompt with an image, the image tokens moved into the prompt. None for every other text encoder, those whose
    tokenizers derive from Qwen-Image's included (HunyuanImage, ...): their edit nodes hand it images otherwise."""
    tokenizer = getattr(clip, "tokenizer", None)
    template = getattr(tokenizer, "llama_template_images", None)
    if type(tokenizer).__name__ != "QwenImageTokenizer" or not isinstance(template, str) or IMAGE_TOKENS not in template:
        return None
    return template.replace(IMAGE_TOKENS, "")


def reads_its_source_images(item, template: str | None) -> bool:
    """Whether an item's caption is encoded with its references (an edit pair's source images): an image item with
    some, under Qwen-Image's text encoder. A clip's start image is the video model's input alone."""
    return template is not None and bool(item.references) and not item.is_clip


def text_image_key(item, dataset: TrainingDataset, store: CacheStore) -> str:
    """What identifies the images the encoder reads beside an item's caption: its references, fitted to the item's
    bucket with the item's crop and flip (as its reference latents are), then scaled to VISION_PIXELS."""
    return content_key(kind="vision_input", format=VISION_FORMAT,
                       sources=[store.source_digest(r) for r in item.references[:MAX_SOURCE_IMAGES]],
                       target=source_digest(item, store), bucket=list(item.bucket), crop=dataset.buckets.crop,
                       flip=item.flip, background=list(dataset.background), pixels=VISION_PIXELS)


def vision_input(reference):
    """A reference image [1, H, W, 3] (0..1) as TextEncodeQwenImageEditPlus hands it to the text encoder: scaled to
    about VISION_PIXELS pixels with its aspect kept, by area (comfy.utils.common_upscale's "area", uncropped)."""
    import math
    import torch
    samples = reference.movedim(-1, 1)
    scale = math.sqrt(VISION_PIXELS / (samples.shape[3] * samples.shape[2]))
    size = (round(samples.shape[2] * scale), round(samples.shape[3] * scale))
    return torch.nn.functional.interpolate(samples, size=size, mode="area").movedim(1, -1)[:, :, :, :3]


def edit_tokens(clip, caption: str, item, dataset: TrainingDataset, store: CacheStore, template: str):
    """The caption with the item's source images, tokenized as TextEncodeQwenImageEditPlus does."""
    images = [vision_input(load_reference_tensor(r, item, dataset.buckets.crop, source_digest(item, store),
                                                 dataset.background))
              for r in item.references[:MAX_SOURCE_IMAGES]]
    pictures = "".join(f"Picture {n + 1}: {IMAGE_TOKENS}" for n in range(len(images)))
    return clip.tokenize(pictures + caption, images=images, llama_template=template)


def is_video_vae(vae) -> bool:
    """Whether a ComfyUI VAE encodes frames together into video latents (B, C, T, H, W)."""
    return getattr(vae, "latent_dim", 2) == 3


def as_start_image(image, frames: int):
    """A clip item's reference as ComfyUI's image-to-video nodes encode a start image (WanImageToVideo): the
    image followed by mid-gray frames to the clip's length, so its latent has the clip latent's frames (a causal
    video VAE's first latent frame is the image's alone, what Wan 2.2 TI2V takes). An image item's: the image."""
    import torch
    if frames <= 1:
        return image
    padded = torch.full((frames, *image.shape[1:]), 0.5, dtype=image.dtype)
    padded[:1] = image
    return padded


OWN_FIRST_FRAME = "window's first frame"  # stands for a reference digest in the key of such a start image


def starts_from_own_frame(item) -> bool:
    """Whether a clip item's first reference slot (its start image) is the item's own first frame: a window that
    does not start the clip. `name.ref.png` beside a clip is the clip's start image, so it is the start image of
    the window at the clip's start only; an image-to-video model learns to continue its start image, and a window
    further in continues from the frame it starts with."""
    return item.is_clip and item.start > 0 and bool(item.references)


def source_digest(item, store: CacheStore) -> str:
    return clip_digest(item.path, store.source_digest, IMAGE_EXTENSIONS) if item.is_clip \
        else store.source_digest(item.path)


def check_audio_source(item, audio_vae, fps: float) -> None:
    """An item cached with an audio VAE is a clip from a video file (a folder of frames or a still image has no
    sound) read at the dataset's frame rate (the one its sound is timed by, and the model told), long enough for one
    audio latent, and the VAE is an audio VAE; the error names the file, or the input."""
    if not is_audio_vae(audio_vae):
        raise DatasetError("audio_vae: this VAE does not encode audio for a video model (connect LTX-2's audio VAE "
                           "from Load LTXV Audio VAE, or MiniMax H3's from Load VAE; or leave audio_vae unconnected "
                           "to train on video alone)")
    if not item.is_clip or Path(item.path).is_dir():
        what = "folder of frames" if item.is_clip else "image"
        raise DatasetError(f"{what} {shown(item.path)}: the audio VAE encodes each clip's sound, and a {what} has "
                           "none; train on video files with sound, or leave audio_vae unconnected")
    if fps <= 0:
        raise DatasetError("fps: the clips' sound is timed by their frames at the dataset's frame rate, which 0 (each "
                           "clip at its own) leaves unknown to the model; set fps on Load Training Images (LTX-2: "
                           "24 or 25, MiniMax H3: 24), or leave audio_vae unconnected")
    timing = audio_timing_problem(audio_vae, item.frames, fps)
    if timing:
        raise DatasetError(f"clip {shown(item.path)}: {timing}")
    if audio_latent_count(audio_vae, item.frames, fps) < 1:
        raise DatasetError(f"clip {shown(item.path)}: its {item.frames}-frame items last {item.frames / fps:.3f} s at "
                           f"{fps:g} fps, shorter than one audio latent; use longer frame buckets")


def encode_latents(dataset: TrainingDataset, vae, store: CacheStore, progress: Progress | None = None,
                   audio_vae=None):
    """Returns (dataset with latent entries, encoded count, reused count). A clip item's frames become one video
    latent [C, T, h, w] (a video VAE's); its reference images are encoded beside it, one `reference<n>` tensor
    per slot on the item's bucket (a clip window's start image: starts_from_own_frame). With an `audio_vae`, each
    clip item's sound over its frames becomes an `audio` latent [C, T, F] beside them (cache/audio.py)."""
    encoder = vae_identity(vae)
    audio_encoder = vae_identity(audio_vae) if audio_vae is not None else ""
    items, encoded, reused = [], 0, 0
    for n, item in enumerate(dataset.items):
        if item.frames > 1 and not is_video_vae(vae):
            raise DatasetError(f"clip {shown(item.path)}: its {item.frames}-frame items need a video VAE (Wan, "
                               "HunyuanVideo, LTX-Video ...); this VAE encodes single images. Connect the video "
                               "model's VAE, or set frame_buckets to 1 to train on single frames")
        if audio_vae is not None:
            check_audio_source(item, audio_vae, clip_fps(item, dataset.fps))
        digest = source_digest(item, store)
        own_first_frame = starts_from_own_frame(item)
        reference_digests = [OWN_FIRST_FRAME if own_first_frame and slot == 0 else store.source_digest(r)
                             for slot, r in enumerate(item.references)]
        key = latent_key(digest, item, dataset, encoder, mask_digest(item, store), reference_digests, audio_encoder)
        entry = store.lookup(key)
        if entry is None:
            if item.is_clip:  # decoded frame by frame, only the item's frames kept
                pixels = load_clip_item_tensor(item, dataset.fps, dataset.buckets.crop, digest, dataset.background)
            else:
                pixels = load_image_tensor(item.path, item.bucket, dataset.buckets.crop, item.flip, digest,
                                           dataset.background)
            latent = vae.encode(pixels[:, :, :, :3])
            tensors = {"latent": latent[0].float()}
            for slot, path in enumerate(item.references):  # each with the target's crop and flip
                ref = pixels[:1, :, :, :3] if own_first_frame and slot == 0 else \
                    load_reference_tensor(path, item, dataset.buckets.crop, digest, dataset.background)
                tensors[f"reference{slot}"] = vae.encode(as_start_image(ref, item.frames))[0].float()
            if audio_vae is not None:  # the sound over the item's frames, at the rate they are read
                tensors["audio"] = clip_audio_latent(audio_vae, item.path, item.start, item.frames,
                                                     clip_fps(item, dataset.fps))
            if item.mask_source:  # same crop, flip and random-crop seed as the pixels above
                mask = load_mask_tensor(item.path, item.mask_source, item.bucket, dataset.buckets.crop, item.flip,
                                        digest)
                tensors["mask"] = mask_to_latent_grid(mask, tensors["latent"].shape)
            meta = {"source": item.path, "bucket": f"{item.bucket[0]}x{item.bucket[1]}"}
            if item.is_clip:
                meta.update(start=item.start, frames=item.frames)
            entry = store.put("latent", key, tensors, meta)
            encoded += 1
        else:
            reused += 1
        items.append(dataclasses.replace(item, latent=entry.key, latent_sha=entry.checksum))
        if progress:
            progress(n + 1, len(dataset.items))
    return dataclasses.replace(dataset, items=tuple(items), latent_encoder=encoder, audio_encoder=audio_encoder), \
        encoded, reused


def encode_text(dataset: TrainingDataset, clip, store: CacheStore, progress: Progress | None = None):
    """Returns (dataset with text entries, encoded count, reused count). Besides each caption: its
    dataset.caption_variants tag-shuffled variants, and the empty caption, which is
    what "no text" means to a ComfyUI text encoder: the graph's CLIP encoding "" (its padding and special
    tokens included, as CLIPTextEncode with an empty prompt gives). Counts are of distinct texts.
    Under Qwen-Image's text encoder an edit pair's caption and its variants are encoded with its source images
    (reads_its_source_images), as TextEncodeQwenImageEditPlus conditions the model at inference; the empty
    caption of caption dropout stays text alone."""
    encoder = clip_identity(clip)
    keeps_extras = returns_text_extras(clip)
    template = edit_prompt_template(clip)
    counts, done = [0, 0], {}

    def cached(caption: str, counted: bool = True, item=None, image: str = "") -> tuple[str, str]:
        """`item`, `image`: the edit pair whose source images the encoder reads, and their text_image_key."""
        key = text_key(caption, encoder, image)
        if key not in done:
            entry = store.lookup(key)
            if entry is None:
                tokens = clip.tokenize(caption) if item is None else \
                    edit_tokens(clip, caption, item, dataset, store, template)
                out = clip.encode_from_tokens(tokens, return_pooled=True, return_dict=True)
                tensors = {"cond": out["cond"][0].float()}
                if out.get("pooled_output") is not None:
                    tensors["pooled"] = out["pooled_output"][0].float()
                if hasattr(out.get("attention_mask"), "shape"):  # [1, tokens]: 1 on a token, 0 on padding
                    tensors["attention_mask"] = out["attention_mask"][0].long()
                for name, value in out.items() if keeps_extras else ():  # as returned: extra_conds reads their shapes
                    if name not in ("cond", "pooled_output", "attention_mask") and hasattr(value, "is_floating_point"):
                        tensors[TEXT_EXTRA + name] = value.float() if value.is_floating_point() else value
                meta = {"caption": caption, **({"images": list(item.references)} if item is not None else {})}
                entry = store.put("text", key, tensors, meta)
                counts[0] += counted
            else:
                counts[1] += counted
            done[key] = (entry.key, entry.checksum)
        return done[key]

    items = []
    for n, item in enumerate(dataset.items):
        source = dict(item=item, image=text_image_key(item, dataset, store)) \
            if reads_its_source_images(item, template) else {}  # once per item, for its caption and variants
        text, text_sha = cached(item.caption, **source)
        variants = tuple(cached(v, **source) for v in caption_variants_of(item.caption, dataset.caption_variants,
                                                                          dataset.keep_tags))
        items.append(dataclasses.replace(item, text=text, text_sha=text_sha, text_variants=variants))
        if progress:
            progress(n + 1, len(dataset.items))
    # the empty caption, always: what caption dropout draws and what a teacher's classifier-free guidance needs
    # (Distill); one encoding per text encoder, counted only where the dataset's dropout asks for it
    empty = cached("", counted=dataset.needs_empty_text)
    return dataclasses.replace(dataset, items=tuple(items), text_encoder=encoder, empty_text=empty,
                               keeps_text_extras=keeps_extras), *counts


def record_usage(dataset: TrainingDataset, store: CacheStore):
    """Marks the entries this dataset uses, so that pruning keeps them: its latents under its VAE's identity,
    its captions under its text encoder's, so caching the same folder for another model evicts nothing."""
    latents = {i.latent for i in dataset.items if i.latent}
    # the audio VAE too: the same folder cached with and without the clips' sound is two sets of entries
    latent_encoder = dataset.latent_encoder + (f"+audio:{dataset.audio_encoder}" if dataset.audio_encoder else "")
    for role, encoder, keys in (("latent", latent_encoder, sorted(latents)),
                                ("text", dataset.text_encoder, [k for k in dataset.cache_keys() if k not in latents])):
        if encoder and keys:
            # replaces the record of versions that named a dataset without its encoders
            store.set_dataset(dataset.usage_identity(role, encoder), dataset.folder, keys,
                              replaces=(dataset.identity,))
