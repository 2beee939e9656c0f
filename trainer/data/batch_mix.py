"""What each step's global batch is made of beyond StepSampler's indices: which text each slot sees (caption
dropout, tag-shuffled variants), the loss masks cached with the latents, and prior (regularisation) images
mixed in at a fixed share of the slots with their own loss weight.

Every draw is a pure function of (seed, step) over the whole global batch, and each rank takes its slots
with micro_batch_slots, the layout the loop cuts indices, noise and timesteps with; so 1 and N processes,
and a resumed run, see exactly the same texts, prior items and weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .loading import (StepSampler, seeded_generator, stack_audio, stack_conds, stack_references, stack_text_extras,
                      stack_text_masks)
from .dataset_checks import (check_caption_features, check_dataset_for_family, check_eval_references,
                             reference_slots, text_inputs_beside_the_embedding)

# generator streams (loading.py uses 1, 2 and 4, evaluation 3): one per kind of draw, so adding one changes no other
TEXT_CHOICE_STREAM = 11
PRIOR_SLOT_STREAM = 12
PRIOR_PICK_STREAM = 13


def micro_batch_slots(batch_size: int, grad_accum: int, world: int, data_rank: int) -> list[slice]:
    """This rank's micro-batches as slices of the step's global batch: micro-batch m of data-parallel rank r
    holds slots (m * world + r) * batch_size onwards, so the global batch is the same on any layout."""
    return [slice((m * world + data_rank) * batch_size, (m * world + data_rank + 1) * batch_size)
            for m in range(grad_accum)]


# --- captions: dropout and tag-shuffled variants ------------------------------------------------------------

@dataclass(frozen=True)
class TextDraw:
    """Per global-batch slot: whether it sees the empty caption, and a uniform number in [0, 1) that picks
    which of its item's tag-shuffled variants it sees (floor(pick * number of variants))."""
    empty: torch.Tensor  # bool [slots]
    pick: torch.Tensor  # float64 [slots]

    def __getitem__(self, slots: slice) -> "TextDraw":
        return TextDraw(self.empty[slots], self.pick[slots])

    def __len__(self) -> int:
        return len(self.empty)


def text_draw(seed: int, step: int, global_batch: int, caption_dropout: float) -> TextDraw:
    """The text choice of every slot of a step's global batch (slice it per micro-batch with
    micro_batch_slots). Drawn even at dropout 0, which then leaves every slot its caption."""
    u = torch.rand((global_batch, 2), generator=seeded_generator(seed, TEXT_CHOICE_STREAM, step),
                   dtype=torch.float64)
    return TextDraw(u[:, 0] < caption_dropout, u[:, 1])


def _text_ref(part, j: int, empty: bool, pick: float | None, shuffle_tags: bool) -> tuple[str, str]:
    if empty:
        if part.empty_text is None:
            raise ValueError("caption dropout needs the empty caption's embedding, which this manifest lacks")
        return part.empty_text
    variants = part.text_variants[j] if shuffle_tags and part.text_variants else ()
    if pick is not None and variants:
        return variants[min(int(pick * len(variants)), len(variants) - 1)]
    return part.text_keys[j], part.text_shas[j]


# --- masks and the batch -----------------------------------------------------------------------------------

class TrainingBatch(NamedTuple):
    latents: torch.Tensor
    cond: torch.Tensor
    pooled: torch.Tensor | None
    mask: torch.Tensor | None  # [B, 1, (1,) h, w] loss weights per latent pixel, or None when nothing is masked
    references: list[torch.Tensor] | None = None  # Batch.references: one [B, C, (T,) h, w] per slot, or None
    text_mask: torch.Tensor | None = None  # Batch.text_mask: [B, tokens] (stack_text_masks), or None
    text_extras: dict | None = None  # Batch.text_extras (stack_text_extras), or None
    audio: torch.Tensor | None = None  # Batch.audio: [B, C, T, F] (stack_audio), or None


def training_batch(dataset, indices: list[int], draw: TextDraw | None = None, shuffle_tags: bool = True,
                   masked_loss: bool = True) -> TrainingBatch:
    """One micro-batch of a CachedDataset or MixedDataset: latents, the text each slot drew (`draw`, sliced to
    these slots; None: every item's caption as written, as evaluation uses), and the masks stored in the latent
    shards (items without one weigh 1 everywhere). With no draw, no variants and no masks this is exactly
    CachedDataset.batch."""
    latents, texts, masks, shards, sources = [], [], [], [], []
    for n, i in enumerate(indices):
        part, j = locate(dataset, i)
        shard = part.latent_shard(j)
        latents.append(shard["latent"])
        shards.append(shard)
        sources.append(part.sources[j])
        masked = masked_loss and bool(part.masked) and part.masked[j]
        if masked and "mask" not in shard:
            raise ValueError(f"cache entry {part.latent_keys[j]} of {part.sources[j]} has no mask though the "
                             "manifest says it is masked; run Cache Latents again")
        masks.append(shard["mask"] if masked else None)
        key, sha = _text_ref(part, j, bool(draw.empty[n]) if draw is not None else False,
                             float(draw.pick[n]) if draw is not None else None, shuffle_tags)
        texts.append(part.text_entry(key, sha))
    stacked = torch.stack(latents)
    cond = stack_conds([t["cond"] for t in texts])
    pooled = torch.stack([t["pooled"] for t in texts]) if all("pooled" in t for t in texts) else None
    mask = None
    if any(m is not None for m in masks):
        ones = torch.ones((1,) * (stacked.dim() - 3) + tuple(stacked.shape[-2:]))
        mask = torch.stack([m if m is not None else ones for m in masks])
    return TrainingBatch(stacked, cond, pooled, mask,
                         stack_references(shards, reference_slots(dataset), sources), stack_text_masks(texts),
                         stack_text_extras(texts), stack_audio(shards, sources))


# --- prior (regularisation) images -------------------------------------------------------------------------

class MixedDataset:
    """The training set and the prior set as one index space: [0, len(main)) are training items, the rest
    prior items. Evaluation stays on the training set (`unique`)."""

    def __init__(self, main, prior):
        self.main, self.prior = main, prior
        self.offset = len(main)
        self.buckets = list(main.buckets) + list(prior.buckets)
        self.sources = list(main.sources) + list(prior.sources)
        self.unique = main.unique

    def __len__(self):
        return self.offset + len(self.prior)

    def locate(self, i: int):
        return (self.main, i) if i < self.offset else (self.prior, i - self.offset)

    @property
    def reference_slots(self) -> int:
        return reference_slots(self)

    def batch(self, indices: list[int]):
        b = training_batch(self, indices, masked_loss=False)
        return b.latents, b.cond, b.pooled

    def references(self, indices: list[int]):
        """As CachedDataset.references, over both sets (evaluation on a run with prior images): the latent shards
        only, no text."""
        if not self.reference_slots:
            return None
        located = [self.locate(i) for i in indices]
        shards = [part.latent_shard(j) for part, j in located]
        return stack_references(shards, self.reference_slots, [part.sources[j] for part, j in located])

    def text_masks(self, indices: list[int]):
        """As CachedDataset.text_masks, over both sets (evaluation on a run with prior images): the captions as
        written, no latents."""
        return stack_text_masks([part.text(j) for part, j in map(self.locate, indices)])

    def text_extras(self, indices: list[int]):
        """As CachedDataset.text_extras, over both sets."""
        return stack_text_extras([part.text(j) for part, j in map(self.locate, indices)])

    def audio_latents(self, indices: list[int]):
        """As CachedDataset.audio_latents, over both sets."""
        located = [self.locate(i) for i in indices]
        return stack_audio([part.latent_shard(j) for part, j in located], [part.sources[j] for part, j in located])


def locate(dataset, i: int):
    """(CachedDataset, index in it) of index i of a CachedDataset or a MixedDataset."""
    return dataset.locate(i) if isinstance(dataset, MixedDataset) else (dataset, i)


def prior_slot_count(global_batch: int, prior_fraction: float) -> int:
    """Prior slots in every global batch: prior_fraction of it, rounded; at least one, and at least one slot
    left for the training images."""
    n = round(global_batch * prior_fraction)
    if not 1 <= n <= global_batch - 1:
        raise ValueError(f"data.prior_fraction: {prior_fraction} of a global batch of {global_batch} gives {n} "
                         f"prior slots; it must give 1 to {global_batch - 1} (raise batch_size or "
                         "gradient_accumulation, or change prior_fraction)")
    return n


class PriorMixSampler:
    """StepSampler's interface (indices, noise_and_timesteps, batches_per_epoch, global_batch) over a
    MixedDataset: every step's global batch holds prior_slot_count prior items at seeded slots, and the
    training items of StepSampler over the training set (which defines the epoch) in the others.

    Buckets: a batch is one bucket, so the prior items come from the prior set's items in the step's bucket.
    Where the prior set has none in that bucket, those slots take more training items of that bucket (a
    seeded draw, weight 1) and the step has no prior item: the step stays full and stackable, and
    uncovered_buckets() names those buckets so the run can say so at start. With bucketing off (one
    square size) every step is covered."""

    noise_and_timesteps = StepSampler.noise_and_timesteps  # the same noise and timesteps: seed, global_batch
    audio_noise = StepSampler.audio_noise

    def __init__(self, main_buckets, prior_buckets, global_batch: int, seed: int, shuffle: bool = True,
                 prior_fraction: float = 0.5):
        self.global_batch, self.seed = global_batch, seed
        self.prior_slots = prior_slot_count(global_batch, prior_fraction)
        self.main = StepSampler(list(main_buckets), global_batch - self.prior_slots, seed, shuffle)
        self.batches_per_epoch = self.main.batches_per_epoch
        self.offset = len(main_buckets)
        self.main_buckets = list(main_buckets)
        self.main_groups = _groups(main_buckets, 0)
        self.prior_groups = _groups(prior_buckets, self.offset)

    def uncovered_buckets(self) -> list[tuple[int, int]]:
        return [b for b in self.main_groups if b not in self.prior_groups]

    def indices(self, step: int) -> list[int]:
        main = self.main.indices(step)
        bucket = self.main_buckets[main[0]]
        pool = self.prior_groups.get(bucket, self.main_groups[bucket])
        order = pool[torch.randperm(len(pool), generator=seeded_generator(self.seed, PRIOR_PICK_STREAM, step))]
        picks = order.repeat(math.ceil(self.prior_slots / len(order)))[:self.prior_slots].tolist()
        slots = torch.randperm(self.global_batch, generator=seeded_generator(self.seed, PRIOR_SLOT_STREAM, step))
        prior_at = dict(zip(sorted(slots[:self.prior_slots].tolist()), picks))
        rest = iter(main)
        return [prior_at[s] if s in prior_at else next(rest) for s in range(self.global_batch)]

    def is_prior(self, indices: list[int]) -> torch.Tensor:
        return torch.tensor([i >= self.offset for i in indices], dtype=torch.bool)


def _groups(buckets, offset: int) -> dict[tuple[int, int], torch.Tensor]:
    groups: dict[tuple[int, int], list[int]] = {}
    for i, b in enumerate(buckets):
        groups.setdefault(tuple(b), []).append(offset + i)
    return {b: torch.tensor(v) for b, v in groups.items()}


def sample_weights(is_prior: torch.Tensor, prior_weight: float) -> torch.Tensor:
    """The loss weight of each slot: prior_weight for prior items, 1 for training items."""
    return torch.where(is_prior, torch.tensor(float(prior_weight)), torch.tensor(1.0))


def loss_parts(per_sample: torch.Tensor, is_prior: torch.Tensor) -> torch.Tensor:
    """[training loss sum, training count, prior loss sum, prior count] of a micro-batch's unweighted per-sample
    losses, detached: sum them over micro-batches and all-reduce over ranks, then split_losses (no host sync
    until the numbers are reported)."""
    per_sample = per_sample.detach().float()
    prior = is_prior.to(per_sample.device)
    main = ~prior
    zero = torch.zeros((), device=per_sample.device)
    # torch.where, not boolean indexing: indexing sizes its result on the host, a wait per micro-batch
    return torch.stack([torch.where(main, per_sample, zero).sum(), main.sum().float(),
                        torch.where(prior, per_sample, zero).sum(), prior.sum().float()])


def split_losses(parts: torch.Tensor) -> dict:
    """{"main_loss", "prior_loss"} for the step event: mean unweighted loss of the training and of the prior items
    of the step (None for a group the step had none of)."""
    main_sum, main_n, prior_sum, prior_n = (float(v) for v in parts.cpu())
    return {"main_loss": main_sum / main_n if main_n else None, "prior_loss": prior_sum / prior_n if prior_n else None}


def prior_report(dataset, sampler) -> tuple[dict, str | None]:
    """(fields for the started event, a warning or None) about the prior set: how many prior items, and the
    training buckets no prior item shares, whose steps train without prior images."""
    if not isinstance(sampler, PriorMixSampler):
        return {}, None
    uncovered = [list(b) for b in sampler.uncovered_buckets()]
    fields = {"prior_items": len(dataset.prior.unique), "prior_slots": sampler.prior_slots,
              "prior_uncovered_buckets": uncovered}
    if not uncovered:
        return fields, None
    return fields, (f"data.prior_manifest: no prior image has the size of the training bucket(s) "
                    f"{', '.join(f'{w}x{h}' for w, h in uncovered)}; steps in those buckets train without prior "
                    "images (their prior slots take more training images). Cache prior images of those sizes, or "
                    "turn bucketing off.")


# --- what the training loop calls --------------------------------------------------------------------------

def build_training_data(data_spec, global_batch: int, seed: int, family=None, pipeline_stages: int = 1):
    """(dataset, sampler) for training from the spec's data section: the training manifest, mixed with the
    prior manifest when there is one (a MixedDataset and a PriorMixSampler), else the CachedDataset and
    StepSampler as before. Fails here, before any step, where the manifests cannot serve caption dropout, or
    carry reference images that `family` cannot take (pipeline stages: pipeline.check_data), or the evaluation
    set's reference images differ in number from the training set's."""
    from .loading import load_cached_dataset
    dataset = load_cached_dataset(data_spec.manifest)
    if family is not None:  # the training clips' frame rate, where the model's conditioning takes one
        family.read_dataset(dataset)
    if data_spec.prior_manifest:
        prior = load_cached_dataset(data_spec.prior_manifest)
        dataset = MixedDataset(dataset, prior)
        sampler = PriorMixSampler(dataset.main.buckets, prior.buckets, global_batch, seed, data_spec.shuffle,
                                  data_spec.prior_fraction)
    else:
        sampler = StepSampler(dataset.buckets, global_batch, seed, data_spec.shuffle)
    check_caption_features(dataset, data_spec.caption_dropout)
    if family is not None:
        check_dataset_for_family(dataset, family)
    if getattr(data_spec, "eval_manifest", ""):  # a held-out evaluation set: its references checked now, too
        check_eval_references(dataset, load_cached_dataset(data_spec.eval_manifest), family)
    beside_text = text_inputs_beside_the_embedding(family, dataset) if pipeline_stages > 1 else ""
    if beside_text:
        raise ValueError(f"data.manifest: its captions carry the text encoder's {beside_text}, which "
                         f"{family.display_name} reads and pipeline stages (distributed.pipeline_stages > 1) do not "
                         "pass on; train with 1 stage")
    return dataset, sampler


class MicroBatch(NamedTuple):
    """The loop's micro-batch tuple (latents, cond, noise, timesteps, pooled), then what the features add."""
    latents: torch.Tensor
    cond: torch.Tensor
    noise: torch.Tensor
    timesteps: torch.Tensor
    pooled: torch.Tensor | None
    mask: torch.Tensor | None = None  # loss weights per latent pixel (objectives.per_sample_loss's mask), or None
    sample_weight: torch.Tensor | None = None  # loss weight per sample (objectives.batch_loss); None: no prior set
    is_prior: torch.Tensor | None = None  # bool per sample, for loss_parts; None without prior images
    references: list | None = None  # Batch.references (reference latents per slot), or None
    text_mask: torch.Tensor | None = None  # Batch.text_mask (the text encoder's attention mask), or None
    text_extras: dict | None = None  # Batch.text_extras (the text encoder's other outputs), or None
    audio: torch.Tensor | None = None  # Batch.audio (the clips' audio latents), or None
    audio_noise: torch.Tensor | None = None  # Batch.audio_noise, where there is audio

    def model_inputs(self) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of TrainingModule.forward: the features go as keywords, and only
        where the step has them, so a plain run calls the model exactly as before."""
        features = {"mask": self.mask, "sample_weight": self.sample_weight, "is_prior": self.is_prior,
                    "references": self.references, "text_mask": self.text_mask, "text_extras": self.text_extras,
                    "audio": self.audio, "audio_noise": self.audio_noise}
        return tuple(self[:5]), {k: v for k, v in features.items() if v is not None}


def load_step(dataset, sampler, step: int, data_spec, seed: int, batch_size: int, grad_accum: int, world: int,
              data_rank: int, timesteps_of=lambda uniform: uniform):
    """This rank's micro-batches of one step: (global indices, [MicroBatch], the global batch's timesteps).
    Every draw (items, prior slots, texts, noise, timesteps) is made for the global batch and sliced with
    micro_batch_slots, so any layout trains on the same samples. With no prior set, no dropout, no variants and
    no masks, latents, cond, pooled, noise and timesteps are exactly what the loop loaded before."""
    indices = sampler.indices(step)
    slots = micro_batch_slots(batch_size, grad_accum, world, data_rank)
    draw = text_draw(seed, step, len(indices), data_spec.caption_dropout)
    batches = [training_batch(dataset, indices[s], draw[s], data_spec.shuffle_tags, data_spec.masked_loss)
               for s in slots]
    noise, uniform = sampler.noise_and_timesteps(step, tuple(batches[0].latents.shape[1:]))
    audio_noise = sampler.audio_noise(step, tuple(batches[0].audio.shape[1:])) if batches[0].audio is not None \
        else None
    timesteps = timesteps_of(uniform)
    is_prior = sampler.is_prior(indices) if isinstance(sampler, PriorMixSampler) else None
    weights = sample_weights(is_prior, data_spec.prior_weight) if is_prior is not None else None
    micro = [MicroBatch(b.latents, b.cond, noise[s], timesteps[s], b.pooled, b.mask,
                        weights[s] if weights is not None else None, is_prior[s] if is_prior is not None else None,
                        b.references, b.text_mask, b.text_extras, b.audio,
                        audio_noise[s] if audio_noise is not None else None)
             for b, s in zip(batches, slots)]
    return indices, micro, timesteps


@dataclass
class StepBatch:
    """This rank's share of one optimizer step, with what the step event reports about the global batch."""
    micro_batches: list  # [MicroBatch], on the CPU
    buckets: list  # the aspect-ratio buckets of the global batch
    timestep_mean: float
    timestep_std: float
    latent_std: float  # mean over this rank's micro-batches


class StepBatches:
    """Loads step s's batch for this rank (data-parallel rank `data_rank` of `world` replicas) with load_step:
    the global batch, its texts, prior items, noise and timesteps are the same on any layout. Runs in the
    loader (data.step_loader), statistics included."""

    def __init__(self, dataset, sampler, train, data_spec, world: int, data_rank: int):
        self.dataset, self.sampler, self.t, self.data = dataset, sampler, train, data_spec
        self.world, self.data_rank = world, data_rank

    def __call__(self, step: int) -> StepBatch:
        from ..objectives import training_timesteps
        t = self.t
        indices, micro, timesteps = load_step(
            self.dataset, self.sampler, step, self.data, t.seed, t.batch_size, t.grad_accum, self.world,
            self.data_rank, lambda uniform: training_timesteps(uniform, t.timestep_sampling, t.logit_mean, t.logit_std))
        latent_std = [m.latents.float().std().item() for m in micro]
        return StepBatch(micro, sorted({self.dataset.buckets[i] for i in indices}), timesteps.mean().item(),
                         timesteps.std().item() if len(timesteps) > 1 else 0.0, sum(latent_std) / len(latent_std))
