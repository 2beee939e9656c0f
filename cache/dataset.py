"""Training datasets: the items of a folder of images or clips with captions, as paths and text (pixels stay on
disk), and what two datasets must share to be mixed. folder_scan.py reads a folder into one."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from .buckets import BucketSettings
from .pixels import DEFAULT_BACKGROUND, DatasetError


@dataclass(frozen=True)
class DatasetItem:
    path: str
    caption: str
    bucket: tuple[int, int] = (0, 0)  # (width, height) the image is resized and cropped to
    flip: bool = False
    latent: str = ""  # cache key of this item's latent, once cached
    latent_sha: str = ""
    text: str = ""  # cache key of this caption's embedding, once cached
    text_sha: str = ""
    pixels: str = ""  # how decoding differs from plain 8-bit RGB (pixel_variant); part of the latent's key
    mask_source: str = ""  # path of its mask image, ALPHA_MASK, or "" (no mask: every latent pixel weighs 1)
    # (key, sha) of each cached tag-shuffled variant of the caption (TrainingDataset.caption_variants of them)
    text_variants: tuple[tuple[str, str], ...] = ()
    # a clip item (path: a video file or a folder of frames): `frames` frames from frame `start` of the clip at
    # the dataset's fps; 0 frames: a still image
    frames: int = 0
    start: int = 0
    # reference images (edit models' source image, image-to-video's start image), one path per reference slot,
    # cached in the item's latent shard on its bucket's grid
    references: tuple[str, ...] = ()

    @property
    def is_clip(self) -> bool:
        return self.frames > 0


@dataclass(frozen=True)
class TrainingDataset:
    folder: str
    items: tuple[DatasetItem, ...]
    buckets: BucketSettings
    repeats: int = 1
    skipped_files: tuple[str, ...] = field(default=())
    background: tuple[int, int, int] = DEFAULT_BACKGROUND
    latent_encoder: str = ""  # identity of the VAE its latents were cached with (encoding.vae_identity)
    # identity of the audio VAE its clips' sound was cached with beside their frames (LTX-2's), or "" (no audio)
    audio_encoder: str = ""
    # whether its captions' entries hold the text encoder's extra outputs (encoding.returns_text_extras): where not,
    # the trainer reads no caption to see whether they batch (dataset_checks.check_text_extras_batching)
    keeps_text_extras: bool = False
    text_encoder: str = ""  # identity of the text encoder its captions were cached with
    caption_variants: int = 0  # tag-shuffled variants of each caption cached beside it (0: no shuffling)
    keep_tags: int = 0  # leading comma-separated tags that stay in place when the others are shuffled
    caption_dropout: float = 0.0  # share of training samples that see the empty caption instead (the trainer draws)
    empty_text: tuple[str, str] = ()  # (key, sha) of the empty caption's embedding under text_encoder, once cached
    # (fps, clip mode, frame buckets) where the dataset holds clips; () for images only (their identity unchanged)
    video: tuple = ()

    @property
    def audio(self) -> bool:
        """Whether every item's latent carries its clip's audio latent (Batch.audio)."""
        return bool(self.audio_encoder)

    @property
    def fps(self) -> float:
        return float(self.video[0]) if self.video else 0.0

    @property
    def resolution(self) -> int:
        return self.buckets.resolution

    @property
    def identity(self) -> str:
        """The folder and the settings that shape its items (without encoders: see usage_identity)."""
        shaping = [self.folder, self.buckets.as_key(), self.buckets.crop, self.buckets.flip]
        shaping += [list(self.video)] if self.video else []  # images-only datasets keep their identity
        return hashlib.sha256(json.dumps(shaping).encode()).hexdigest()[:24]

    def usage_identity(self, role: str, encoder: str) -> str:
        """Names this dataset's latents ("latent") or captions ("text") for one encoder in the cache's
        bookkeeping, so caches of one folder for two models (an SDXL and a Flux VAE) do not evict each other."""
        return f"{self.identity}/{role}/{encoder}"

    def __len__(self) -> int:
        return len(self.items)

    @property
    def reference_slots(self) -> int:
        """Reference images per item (0: none; every item has as many), as a cached dataset's manifest says it."""
        return max((len(item.references) for item in self.items), default=0)

    @property
    def has_latents(self) -> bool:
        return all(item.latent for item in self.items)

    @property
    def has_text(self) -> bool:
        return all(item.text for item in self.items) and (not self.needs_empty_text or bool(self.empty_text)) \
            and all(len(item.text_variants) == self.caption_variants for item in self.items)

    @property
    def needs_empty_text(self) -> bool:
        return self.caption_dropout > 0

    def cache_keys(self) -> list[str]:
        """Every cache entry this dataset uses (latents with their masks, captions, their shuffled variants and
        the empty caption): what a run manifest pins and what record_usage keeps."""
        keys = [k for item in self.items for k in (item.latent, item.text, *(v for v, _ in item.text_variants)) if k]
        return keys + ([self.empty_text[0]] if self.empty_text else [])

    def require_cached(self, input_name: str = "dataset"):
        """What a node needs before training or evaluating on it; the error names the input and the fix."""
        if not self.has_latents:
            raise DatasetError(f"{input_name}: latents are not cached; connect it through Cache Latents first")
        if not self.has_text:
            raise DatasetError(f"{input_name}: captions are not encoded; connect it through Cache Text Embeddings "
                               "first")

    def with_items(self, items) -> "TrainingDataset":
        return dataclasses.replace(self, items=tuple(items))


def prior_problems(dataset: TrainingDataset, prior: TrainingDataset, input_name: str = "prior_dataset") -> list[str]:
    """Why a prior (regularisation) dataset cannot be mixed into this one's batches: both must be cached with
    the same VAE and text encoder, or the model would learn from latents and embeddings of another model; and
    caption dropout, which draws over every slot of a batch, needs the prior images' empty caption."""
    problems = []
    if prior.latent_encoder != dataset.latent_encoder:
        problems.append(f"{input_name}: its latents were cached with another VAE than the training images'")
    if prior.text_encoder != dataset.text_encoder:
        problems.append(f"{input_name}: its captions were encoded with another text encoder than the training "
                        "images'")
    if prior.audio_encoder != dataset.audio_encoder:  # a batch holds audio latents for every item or none
        how = ("was cached with another audio VAE than the training clips'" if prior.audio and dataset.audio else
               "was cached with an audio VAE, the training clips' without one" if prior.audio else
               "was not cached, unlike the training clips' (Cache Latents' audio_vae)")
        problems.append(f"{input_name}: its items' sound {how}; cache both sets with the same audio_vae, or both "
                        "without")
    if dataset.caption_dropout > 0 and not prior.empty_text:
        problems.append(f"{input_name}: the training images' caption dropout gives prior images the empty caption "
                        "too, which the prior images' cache lacks; set the same caption_dropout on their Load "
                        "Training Images node (Cache Text Embeddings then caches the empty caption)")
    return problems
