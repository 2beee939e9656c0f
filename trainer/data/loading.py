"""The cached dataset as the trainer sees it: lazy, bucketed, in an order that depends only on (seed, step).

Because the batches and the noise of step s are pure functions of the seed and s, a resumed run and
a run on a different number of processes draw exactly the same samples. Every batch comes from one
aspect-ratio bucket. Shards are read (and checksum-verified) when a batch needs them, one step ahead
in a background thread on an accelerator; the verified shards stay in memory up to a budget (ShardMemo),
so a small dataset is read and hashed once per run rather than at every epoch.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ...cache.encoding import TEXT_EXTRA
from ...cache.shards import load_checked, read_manifest


class ShardMemo:
    """Verified shards kept in memory, least recently used out first, up to a byte budget. Reading a latent
    shard and hashing it cost about 0.3 ms a item on the tiny SD1.5, every step (bench/overhead.py)."""

    def __init__(self, budget_bytes: int):
        self._items: OrderedDict[tuple, tuple[dict, int]] = OrderedDict()
        self._bytes, self._budget = 0, budget_bytes
        self._lock = threading.Lock()  # the prefetch thread and the loop's evaluation read at once

    def get(self, key: tuple, load) -> dict:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key][0]
        value = load()
        size = sum(t.nbytes for t in value.values() if isinstance(t, torch.Tensor))
        with self._lock:
            if key not in self._items and size <= self._budget:
                self._items[key] = (value, size)
                self._bytes += size
                while self._bytes > self._budget:
                    _, (_, freed) = self._items.popitem(last=False)
                    self._bytes -= freed
        return value


# one of each per process, whatever the datasets (training, evaluation, prior images): some 8,000 SD1.5 latents at
# 512² or a few hundred video clips'; some 2,000 CLIP-L captions or 64 T5-XXL ones at 512 tokens
LATENT_MEMO, TEXT_MEMO = ShardMemo(512 << 20), ShardMemo(256 << 20)


@dataclass
class CachedDataset:
    root: str
    latent_keys: list[str]
    latent_shas: list[str]
    text_keys: list[str]
    text_shas: list[str]
    buckets: list[tuple[int, int]]
    sources: list[str]
    unique: list[int]  # one index per cached item (repeats excluded), for evaluation
    # per item: [(key, sha)] of its tag-shuffled caption variants, and whether its latent shard holds a mask
    text_variants: list[list[tuple[str, str]]] = field(default_factory=list)
    masked: list[bool] = field(default_factory=list)
    empty_text: tuple[str, str] | None = None  # the empty caption's embedding (caption dropout), if cached
    reference_slots: int = 0  # reference images in every item's latent shard (reference0 ...; Batch.references)
    fps: float = 0.0  # the clips' frame rate, as the cache resampled them (0: images, or each clip at its own)
    audio: bool = False  # whether every item's latent shard holds its clip's audio latent ("audio"; Batch.audio)
    # whether its text entries may hold the text encoder's extras (None: unknown, a manifest written before it said)
    keeps_text_extras: bool | None = None

    def __len__(self):
        return len(self.latent_keys)

    def latent_shard(self, i: int) -> dict:
        """Item i's latent shard (its latent, and its mask and references where it has them), verified."""
        key, sha = self.latent_keys[i], self.latent_shas[i]
        return LATENT_MEMO.get((self.root, key, sha), lambda: load_checked(self.root, "latent", key, sha))

    def latent(self, i: int) -> torch.Tensor:
        return self.latent_shard(i)["latent"]

    def text(self, i: int) -> dict:
        return self.text_entry(self.text_keys[i], self.text_shas[i])

    def text_entry(self, key: str, sha: str) -> dict:
        """A text embedding by its cache key (a caption, a shuffled variant, the empty caption), verified."""
        return TEXT_MEMO.get((self.root, key, sha), lambda: load_checked(self.root, "text", key, sha))

    def references(self, indices: list[int]) -> list[torch.Tensor] | None:
        """The items' reference latents, one [B, C, (T,) h, w] tensor per slot (Batch.references), or None."""
        if not self.reference_slots:
            return None
        shards = [self.latent_shard(i) for i in indices]
        return stack_references(shards, self.reference_slots, [self.sources[i] for i in indices])

    def text_masks(self, indices: list[int]) -> torch.Tensor | None:
        """The items' text attention masks as batch() stacks their embeddings (stack_text_masks), or None."""
        return stack_text_masks([self.text(i) for i in indices])

    def text_extras(self, indices: list[int]) -> "TextExtras | None":
        """The items' text encoder extras as batch() stacks their embeddings (stack_text_extras), or None."""
        return stack_text_extras([self.text(i) for i in indices])

    def audio_latents(self, indices: list[int]) -> torch.Tensor | None:
        """The items' audio latents, stacked as batch() stacks their latents (Batch.audio), or None."""
        if not self.audio:
            return None
        return stack_audio([self.latent_shard(i) for i in indices], [self.sources[i] for i in indices])

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(latents, text embeddings, pooled text vectors or None where the text encoder has none)."""
        latents = torch.stack([self.latent(i) for i in indices])
        texts = [self.text(i) for i in indices]
        cond = stack_conds([text["cond"] for text in texts])
        pooled = torch.stack([text["pooled"] for text in texts]) if all("pooled" in text for text in texts) else None
        return latents, cond, pooled


def stack_audio(shards: list[dict], sources: list[str]) -> torch.Tensor | None:
    """The items' audio latents as one [B, C, T, F] tensor (Batch.audio), or None where the shards hold none; an
    item of a dataset with audio whose shard lacks it is named."""
    if not any("audio" in shard for shard in shards):
        return None
    for shard, source in zip(shards, sources, strict=True):
        if "audio" not in shard:
            raise ValueError(f"the cache entry of {source} has no audio latent though its dataset has audio; run "
                             "Cache Latents again")
    return torch.stack([shard["audio"] for shard in shards])


def stack_conds(conds: list[torch.Tensor]) -> torch.Tensor:
    """Text embeddings of one batch as one tensor. Lengths can differ (an empty caption against a caption past
    the encoder's minimum length; text encoders that do not pad, such as Chroma's, Qwen-Image's or Lumina 2's):
    then each is repeated to their least common multiple, ComfyUI's own rule for batching cross-attention
    conditioning (comfy/conds.py CONDCrossAttn.concat), within its own limit: no embedding repeated more than 4
    times, past which ComfyUI runs the prompts apart and a batch here would not be what inference sees."""
    lengths = sorted({c.shape[0] for c in conds})
    if len(lengths) > 1:
        total = math.lcm(*lengths)
        if total // lengths[0] > 4:
            raise ValueError(f"train.batch_size: captions in one batch encode to {lengths} tokens, which ComfyUI "
                             f"would not batch together (it repeats an embedding at most 4 times; these need "
                             f"{total // lengths[0]}); this text encoder does not pad its captions: train with "
                             "batch_size 1 and use gradient_accumulation for a larger batch")
        conds = [c.repeat(total // c.shape[0], *([1] * (c.dim() - 1))) for c in conds]
    return torch.stack(conds)


def stack_text_masks(texts: list[dict]) -> torch.Tensor | None:
    """The text encoder's attention masks of one batch's text entries ([B, tokens], 1 on a token, 0 on padding),
    each repeated as stack_conds repeats its embedding; a text cached without one (its encoder returns none, or all
    its tokens count) has no padding. None where no text has a mask: the model attends to every token."""
    if not any("attention_mask" in text for text in texts):
        return None
    masks = [text["attention_mask"].reshape(-1) if "attention_mask" in text
             else torch.ones(text["cond"].shape[0], dtype=torch.long) for text in texts]
    total = math.lcm(*(len(m) for m in masks))
    return torch.stack([m.repeat(total // len(m)) for m in masks])


def each_tensor(value, fn):
    """A batch field with `fn` applied to each of its tensors: a list of them (the reference slots) or a dict (the
    text encoder's extras) keeps its type; None stays None."""
    if isinstance(value, list):
        return type(value)(each_tensor(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)({name: each_tensor(v, fn) for name, v in value.items()})
    return fn(value) if torch.is_tensor(value) else value


class TextExtras(dict):
    """Batch.text_extras: what the text encoder returned beside the embedding, pooled vector and mask (HunyuanDiT's
    mT5 embedding, Anima's T5 token ids ...), by the name ComfyUI's encoder gave it, which is the name its
    extra_conds reads; it moves to a device as one tensor does (the layouts move each micro-batch field with .to)."""

    def to(self, *args, **kwargs) -> "TextExtras":
        return TextExtras({name: t.to(*args, **kwargs) for name, t in self.items()})


ONE_CAPTION_AT_A_TIME = "train with batch_size 1 and use gradient_accumulation for a larger batch"


def per_text_shape(shape) -> tuple:
    """One text's extra output as the encoder returned it, past its batch axis of 1 (a 1-D one, such as Anima's token
    ids, has none): what must match for texts to batch together."""
    return tuple(shape[1:]) if len(shape) > 1 and shape[0] == 1 else tuple(shape)


def text_extras_signature(shapes: dict[str, tuple]) -> tuple:
    """The text encoder's extras a text entry holds (its tensors' shapes by name), by name and per_text_shape: texts
    of one signature batch together (stack_text_extras)."""
    return tuple(sorted((key[len(TEXT_EXTRA):], per_text_shape(shape)) for key, shape in shapes.items()
                        if key.startswith(TEXT_EXTRA)))


def stack_text_extras(texts: list[dict]) -> TextExtras | None:
    """The text encoder's extras of one batch's text entries, each [B, ...], or None where its encoder returns none.
    Each text's is as the encoder returned it, with its batch axis of 1 (a 1-D one, such as Anima's token ids, gets
    one), stacked along it as ComfyUI batches such conditioning, which needs the same shape in every text."""
    names = sorted({k for text in texts for k in text if k.startswith(TEXT_EXTRA)})
    if not names:
        return None
    out = TextExtras()
    for key in names:
        values = [text.get(key) for text in texts]
        name = key[len(TEXT_EXTRA):]
        if any(v is None for v in values):  # HunyuanImage's glyph embedding, of quoted text alone
            raise ValueError(f"train.batch_size: the text encoder gave {name} for some captions of this batch and not "
                             f"others, so ComfyUI would not batch them: {ONE_CAPTION_AT_A_TIME}")
        values = [v.reshape(1, *per_text_shape(v.shape)) for v in values]
        if any(v.shape != values[0].shape for v in values):
            raise ValueError(f"train.batch_size: the text encoder's {name} has a different shape for each caption "
                             f"({[tuple(v.shape[1:]) for v in values]}), so ComfyUI would not batch them: "
                             f"{ONE_CAPTION_AT_A_TIME}")
        out[name] = torch.cat(values)
    return out


def load_cached_dataset(manifest_path: str) -> CachedDataset:
    manifest = read_manifest(manifest_path)
    fields = manifest["fields"]
    col = {name: fields.index(name) for name in fields}
    repeats = int(manifest.get("repeats", 1))
    rows = manifest["items"]
    for row in rows:
        if not row[col["latent"]] or not row[col["text"]]:
            raise ValueError(f"{manifest_path}: item {row[col['source']]} has no cached latent or text embedding")

    def column(name):  # each item `repeats` times in a row
        return [row[col[name]] for row in rows for _ in range(repeats)]
    widths, heights = column("width"), column("height")
    # a batch is one bucket: an aspect-ratio bucket, and for a clip item of more than one frame its frame count
    # (a still image and a 1-frame item have latents of one shape)
    frames = column("frames") if "frames" in col else [0] * len(widths)
    buckets = [(w, h, f) if f > 1 else (w, h) for w, h, f in zip(widths, heights, frames)]
    dataset = CachedDataset(manifest["cache_root"], column("latent"), column("latent_sha256"), column("text"),
                            column("text_sha256"), buckets, column("source"),
                            list(range(0, len(rows) * repeats, repeats)))
    if "references" in col:
        slots = {int(n) for n in column("references")}
        if len(slots) > 1:
            raise ValueError(f"{manifest_path}: items have different numbers of reference images ({sorted(slots)}); "
                             "every item of a dataset needs the same number")
        dataset.reference_slots = slots.pop()
    if "masked" in col:  # manifests written before masks and caption variants have neither
        dataset.text_variants = [[_entry_ref(v, manifest_path) for v in vs] for vs in column("text_variants")]
        dataset.masked = [bool(m) for m in column("masked")]
    if manifest.get("empty_text"):
        dataset.empty_text = _entry_ref(manifest["empty_text"], manifest_path)
    dataset.fps = float(manifest.get("fps") or 0.0)  # manifests written before it: 0
    dataset.audio = bool(manifest.get("audio"))  # manifests written before it: no audio
    dataset.keeps_text_extras = manifest.get("text_extras_kept")
    return dataset


class References(list):
    """Batch.references: a list of tensors, one per reference slot, that moves to a device as one tensor does
    (the layouts move each micro-batch field with .to)."""

    def to(self, *args, **kwargs) -> "References":
        return References(t.to(*args, **kwargs) for t in self)


def stack_references(shards: list[dict], slots: int, sources: list[str]) -> References | None:
    """Reference latents of a batch's latent shards, stacked slot by slot; an error names an item lacking one."""
    if not slots:
        return None
    out = []
    for slot in range(slots):
        name = f"reference{slot}"
        for shard, source in zip(shards, sources):
            if name not in shard:
                raise ValueError(f"cache entry of {source} has no reference image {slot + 1} though the manifest "
                                 "lists it; run Cache Latents again")
        out.append(torch.stack([shard[name] for shard in shards]))
    return References(out)


def _entry_ref(value, manifest_path) -> tuple[str, str]:
    """A [key, sha256] pair of a manifest (load_checked vets the key itself)."""
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        raise ValueError(f"{manifest_path}: a text entry must be [key, sha256] (got {str(value)[:80]})")
    return value[0], value[1]


AUDIO_NOISE_STREAM = 5  # generator stream of the audio latents' noise (StepSampler.audio_noise)


def seeded_generator(*parts: int) -> torch.Generator:
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


class StepSampler:
    """Indices, noise and timesteps of each optimizer step's global batch (all ranks, all micro-batches).

    An epoch: each bucket's items shuffled and cut into global batches (the last one filled up from
    the same bucket), and the batches shuffled. Every epoch has the same number of batches.
    """

    def __init__(self, buckets: list[tuple[int, int]], global_batch: int, seed: int, shuffle: bool = True):
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        groups: dict[tuple[int, int], list[int]] = {}
        for i, b in enumerate(buckets):
            groups.setdefault(b, []).append(i)
        self.groups = [torch.tensor(v) for _, v in sorted(groups.items())]
        self.bucket_sizes = [b for b, _ in sorted(groups.items())]
        self.batches_per_epoch = sum(math.ceil(len(g) / global_batch) for g in self.groups)
        self._epoch: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch[1]
        batches = []
        for b, group in enumerate(self.groups):
            order = group[torch.randperm(len(group), generator=seeded_generator(self.seed, 1, epoch, b))] \
                if self.shuffle else group
            n = math.ceil(len(order) / self.global_batch) * self.global_batch
            padded = order.repeat(math.ceil(n / len(order)))[:n]  # fill up from the same bucket
            batches += padded.view(-1, self.global_batch).tolist()
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=seeded_generator(self.seed, 4, epoch)).tolist()
            batches = [batches[i] for i in perm]
        self._epoch = (epoch, batches)
        return batches

    def indices(self, step: int) -> list[int]:
        return self.epoch_batches(step // self.batches_per_epoch)[step % self.batches_per_epoch]

    def noise_and_timesteps(self, step: int, latent_shape: tuple[int, ...]):
        g = seeded_generator(self.seed, 2, step)
        noise = torch.randn((self.global_batch, *latent_shape), generator=g)
        timesteps = torch.rand((self.global_batch,), generator=g)
        return noise, timesteps

    def audio_noise(self, step: int, audio_shape: tuple[int, ...]):
        """The noise of the global batch's audio latents (Batch.audio_noise): a stream of its own, so a run with
        audio draws the same video noise and timesteps as one without."""
        generator = seeded_generator(self.seed, AUDIO_NOISE_STREAM, step)
        return torch.randn((self.global_batch, *audio_shape), generator=generator)


def step_loader(load, device):
    """What hands the loop each step's batches. On an accelerator the host waits while the device computes, so a
    thread loads the next step meanwhile. On the CPU the cores are the compute: a loader thread there competes
    with the step's own intra-op threads (on 2 cores it made steps 1.4-1.6 times slower, bench/overhead.py),
    while a step's load takes a few milliseconds, so the loop loads in place."""
    import torch
    return Prefetcher(load) if torch.device(device).type != "cpu" else InPlaceLoader(load)


class InPlaceLoader:
    """Loads each step's batches when the loop asks for them (the Prefetcher's interface)."""

    def __init__(self, load):
        self._load = load

    def get(self, step: int, next_step: int | None):
        return self._load(step)

    def close(self):
        pass


class Prefetcher:
    """Loads the next step's batches in a background thread while the current step computes."""

    def __init__(self, load):
        self._load = load
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._pending: dict[int, object] = {}

    def get(self, step: int, next_step: int | None):
        future = self._pending.pop(step, None) or self._pool.submit(self._load, step)
        if next_step is not None and next_step not in self._pending:
            self._pending[next_step] = self._pool.submit(self._load, next_step)
        return future.result()

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
