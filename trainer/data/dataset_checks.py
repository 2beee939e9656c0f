"""What a run checks of its datasets before it starts, so a mismatch is refused naming the setting rather than met
at some step: the caption features caption dropout needs, and the reference images each item carries against what
the model family takes (the one rule for training, distillation and the Evaluate node)."""
from __future__ import annotations

from ...cache.encoding import TEXT_EXTRA


def check_caption_features(dataset, caption_dropout: float, where: str = "data.manifest"):
    """Fails at start-up, not at some step, when the manifest cannot serve caption dropout."""
    for part, name in _parts(dataset, where):
        if caption_dropout > 0 and part.empty_text is None:
            raise ValueError(f"data.caption_dropout: {name} has no empty-caption embedding (a cache written "
                             "before Cache Text Embeddings always stored it); queue Cache Text Embeddings again")


def _parts(dataset, where: str):
    """The dataset's parts with the setting that names each: a MixedDataset's training and prior sets, or itself."""
    if hasattr(dataset, "main") and hasattr(dataset, "prior"):  # batch_mix.MixedDataset
        return [(dataset.main, where), (dataset.prior, "data.prior_manifest")]
    return [(dataset, where)]


def reference_slots(dataset) -> int:
    """Reference images per item (0: none); a prior set must have as many as the training set."""
    return max(part.reference_slots for part, _ in _parts(dataset, ""))


def _check_reference_input(dataset, family, where: str = "data.manifest"):
    """Fails at start-up, naming the setting, where the dataset's items carry reference images the model family
    cannot take (ModelFamily.reference_input is None) or more than it takes, or a prior set's count differs from
    the training set's. The one rule for every task that runs a family on a dataset (training, distillation, the
    Evaluate node); `dataset`: a cached dataset, or the graph's TrainingDataset (both say their reference_slots)."""
    counts = [(name, part.reference_slots) for part, name in _parts(dataset, where)]
    if len({n for _, n in counts}) > 1:
        raise ValueError(f"data.prior_manifest: its items have {counts[1][1]} reference image(s), the training "
                         f"items {counts[0][1]}; a batch needs the same number")
    slots = counts[0][1]
    reference_input = getattr(family, "reference_input", None)
    if slots and reference_input is None:
        from ..models.base import UnsupportedSetting
        raise UnsupportedSetting(f"{where}: its items carry {slots} reference image(s) (name.ref.png or a "
                                 f"reference folder), but {family.display_name} takes none (its reference_input is "
                                 "None); use an edit or image-to-video model, or load the dataset without "
                                 "reference images")
    if slots > 1 and reference_input == "start_image":  # refused here, not at the first step's loss
        from ..models.base import UnsupportedSetting
        raise UnsupportedSetting(f"{where}: its items carry {slots} reference images (name.ref.png, name.ref2.png "
                                 f"...), but {family.display_name} takes one start image per item; keep "
                                 "name.ref.png only")


def check_image_sizes(dataset, family, where: str = "data.manifest"):
    """Fails before the first step, naming the setting and the size, where an item's size is one the family's model
    cannot run at (ModelFamily.image_size_problem). `dataset`: a cached dataset (its items' buckets), or the graph's
    TrainingDataset (its items', at queue time)."""
    size_problem = getattr(family, "image_size_problem", None)  # a ModelFamily's (reference_input's duck typing)
    for part, name in _parts(dataset, where):
        sizes = getattr(part, "buckets", None)
        if not isinstance(sizes, list):  # the graph's dataset: its buckets are its settings, each item has its own
            sizes = [item.bucket for item in getattr(part, "items", ())]
        for bucket in sorted(set(sizes)) if size_problem else ():
            problem = size_problem(int(bucket[0]), int(bucket[1]))
            if problem:
                from ..models.base import UnsupportedSetting
                raise UnsupportedSetting(f"{name}: items of {bucket[0]}x{bucket[1]} px: {problem}")


def check_dataset_for_family(dataset, family, where: str = "data.manifest", cache_root=None):
    """What every task that runs a family on a dataset checks first (training, distillation, the Evaluate node; the
    node at queue time too, on the graph's dataset: its cache's `cache_root`): that its latents and captions come
    from the model's own VAE and text encoder, the reference images its items carry, their sizes, the text
    encoder's extras its captions carry, and their sound."""
    _check_encoders(dataset, family, where, cache_root)
    _check_reference_input(dataset, family, where)
    check_image_sizes(dataset, family, where)
    _check_text_extras(dataset, family, where)
    _check_audio(dataset, family, where)


def _check_encoders(dataset, family, where: str, cache_root=None):
    """Refuses, naming the setting and the fix, latents cached with another model's VAE and captions encoded with
    another model's text encoder, read from the first item's shard headers:
    - latents of other dimensions: a Wan VAE's video latents for a Flux model (its first step failed unpacking them),
      or a Flux VAE's image latents for a Qwen-Image or Wan model (they trained without an error, as one-frame videos
      of latents the model never sees: every VAE of a model on video latents gives an image one frame, [C, 1, H, W]);
    - latents of other channels (an SDXL VAE's 4 for a Flux model's 16: a shape error at the first step);
    - captions of another width (SD1.x's CLIP-L, 768 wide, for SDXL's 2048), where the family names the layer its
      text embedding enters (ModelFamily.text_input_layer);
    - pooled vectors of another width (Flux's T5 and CLIP-L captions for SD3: the same 4096-wide embeddings, pooled
      vectors of 768 for its 2048), where the family names the layer they enter (pooled_input_layer); a wider one
      passes where the model reads its first part (pooled_read_in_part)."""
    from ..models.base import UnsupportedSetting
    for part, name in _parts(dataset, where):
        shapes = _first_item_shapes(part, cache_root)
        if shapes is None:
            continue
        latent, text, pooled = shapes  # [C, H, W] (a video VAE's [C, T, H, W]); [tokens, width]; [width] or None
        if len(latent) + 1 != family.latent_ndim:  # (a batch's dims, which the model takes)
            kinds = {3: "an image VAE's [C, H, W]", 4: "a video VAE's [C, T, H, W]"}
            own = " (its own VAE is a video VAE, which makes an image one frame: [C, 1, H, W])" \
                if family.latent_ndim == 5 else ""
            raise UnsupportedSetting(f"{name}: its latents are {kinds.get(len(latent), 'of another VAE')} "
                                     f"({list(latent)}), and this {family.display_name} model takes "
                                     f"{kinds[family.latent_ndim - 1]}{own}: they were cached with another model's "
                                     "VAE; connect this model's own VAE to Cache Latents' vae and cache them again")
        channels = latent_channels(family)
        if latent[0] != channels:
            raise UnsupportedSetting(f"{name}: its latents have {latent[0]} channels, and this "
                                     f"{family.display_name} model takes {channels}: they were cached "
                                     "with another model's VAE; connect this model's own VAE to Cache Latents' vae "
                                     "and cache them again")
        # a pooled vector wider than the model takes is read in part where its model slices it, as ComfyUI's sampler
        # gives it (Flux's and HunyuanVideo's take the first 768: SD3's captions' CLIP-L part); SD3's takes it whole
        pooled_wrong = int.__lt__ if getattr(family, "pooled_read_in_part", False) else int.__ne__
        for what, shape, expected, wrong in (("embeddings", text, text_width(family), int.__ne__),
                                             ("pooled vectors", pooled, pooled_width(family), pooled_wrong)):
            if expected is not None and shape is not None and wrong(int(shape[-1]), expected):
                raise UnsupportedSetting(f"{name}: its captions' {what} are {shape[-1]} wide, and this "
                                         f"{family.display_name} model takes {expected}: they were encoded with "
                                         "another model's text encoder; connect this model's own CLIP to Cache Text "
                                         "Embeddings' clip and encode them again")


def _first_item_shapes(part, cache_root):
    """(latent shape, caption embedding shape, pooled vector shape or None) of a dataset part's first item, from its
    cache shards' headers: a cached dataset's (the trainer's), or the graph's TrainingDataset's under `cache_root`
    (the node's, at queue time: a shard missing or damaged there is left to the trainer's verified read to name).
    None: nothing cached, or shards that hold no latent or embedding (the pack writes none such)."""
    from ...cache.shards import shard_shapes
    from .loading import CachedDataset
    trainers = isinstance(part, CachedDataset)
    if trainers:
        root, keys = part.root, (part.latent_keys[0], part.text_keys[0]) if len(part) else ("", "")
    else:
        item = next(iter(getattr(part, "items", ())), None) if cache_root is not None else None
        root, keys = cache_root, (item.latent, item.text) if item is not None else ("", "")
    if not all(keys):
        return None
    try:
        latent, text = shard_shapes(root, "latent", keys[0]), shard_shapes(root, "text", keys[1])
    except ValueError:
        if trainers:
            raise  # names the shard missing or damaged
        return None
    return (latent["latent"], text["cond"], text.get("pooled")) if "latent" in latent and "cond" in text else None


def latent_channels(family) -> int:
    """The channels of the latents the family's model takes: its own figure where its latent format's differs
    (ModelFamily.latent_channels: MiniMax H3's packed audio-video format), else its latent format's, as ComfyUI's
    empty latents have."""
    return family.latent_channels or family.base_model.latent_format.latent_channels


def text_width(family) -> int | None:
    """The width of the text embedding the family's model takes: the in_features of its text_input_layer, or None
    where the family names none (the generic family's models, text through connectors: LTX-2)."""
    return _input_width(family, getattr(family, "text_input_layer", None))


def pooled_width(family) -> int | None:
    """The width of the pooled text vector the family's model takes (Flux's and HunyuanVideo's CLIP-L 768, SD3's
    2048): the in_features of its pooled_input_layer; None where the family names none or its model has no such
    layer (Flux.2, Chroma, HunyuanVideo 1.5)."""
    return _input_width(family, getattr(family, "pooled_input_layer", None))


def _input_width(family, pattern: str | None) -> int | None:
    import re
    if not pattern:
        return None
    return next((m.in_features for n, m in family.diffusion_model.named_modules() if re.search(pattern, n)), None)


def _texts(part, caption_dropout: float = 0.0) -> dict[str, str]:
    """Every text a step can draw from a cached dataset's part (its captions, their shuffled variants, the empty
    caption of caption dropout), by cache key, with what it is the caption of."""
    from ...cache.pixels import shown
    texts = {key: shown(part.sources[i]) for i, key in enumerate(part.text_keys)}
    for i, variants in enumerate(part.text_variants):
        texts.update({key: shown(part.sources[i]) for key, _ in variants if key not in texts})
    if caption_dropout > 0 and part.empty_text:
        texts.setdefault(part.empty_text[0], "the empty caption of caption dropout")
    return texts


def _extras_signatures(part, caption_dropout: float = 0.0):
    """(signature, what it is the caption of) of every text of _texts, from the shards' headers alone
    (loading.text_extras_signature); none where the manifest says its text encoder keeps no extras."""
    from ...cache.shards import shard_shapes
    from .loading import text_extras_signature
    if getattr(part, "keeps_text_extras", None) is False:
        return
    for key, source in _texts(part, caption_dropout).items():
        yield text_extras_signature(shard_shapes(part.root, "text", key)), source


def check_text_extras_batching(dataset, batch_size: int, caption_dropout: float = 0.0, where: str = "data.manifest"):
    """Refuses, before any step, micro-batches of several captions that the text encoder gave different extras
    beside the embedding (HunyuanImage 2.1's and HunyuanVideo 1.5's encoder: a glyph embedding for quoted text alone,
    of the quoted text's length; Anima's T5 token ids, of each caption's length), which ComfyUI conditions one
    caption at a time."""
    from .loading import ONE_CAPTION_AT_A_TIME
    if batch_size <= 1:
        return
    found = {}  # signature -> what has it; two are enough to refuse
    for signature, source in (each for part, _ in _parts(dataset, where)
                              for each in _extras_signatures(part, caption_dropout)):
        found.setdefault(signature, source)
        if len(found) > 1:
            break
    else:
        return
    (first, a), (second, b) = found.items()

    def described(signature):
        return ", ".join(f"{name} {list(shape)}" for name, shape in signature) or "nothing more"
    raise ValueError(f"train.batch_size: the text encoder gave the captions other outputs beside the embedding ({a}: "
                     f"{described(first)}; {b}: {described(second)}), which ComfyUI conditions one caption at a time "
                     f"(HunyuanImage's glyph embedding is given for quoted text alone): {ONE_CAPTION_AT_A_TIME}")


def has_audio(dataset) -> bool:
    """Whether the dataset's items carry audio latents beside their video latents (Batch.audio)."""
    return any(getattr(part, "audio", False) for part, _ in _parts(dataset, ""))


def distillation_audio_problem(dataset, where: str) -> str | None:
    """Why distillation cannot run on the dataset's sound, or None: its networks run on video latents alone."""
    if not has_audio(dataset):
        return None
    return (f"{where}: its clips' sound was cached (Cache Latents' audio_vae); distilling a model's audio "
            "stream (LTX-2's, MiniMax H3's) is not yet supported: distil LTX-2 on clips cached without the audio VAE "
            "(MiniMax H3, which always generates sound, cannot be distilled yet)")


def _check_audio(dataset, family, where: str):
    """A dataset whose clips carry audio latents trains a model that takes an audio stream (LTX-2, MiniMax H3), a
    model that always generates sound (MiniMax H3) trains on such a dataset only, and every part of it carries them:
    a batch cannot mix items with and without audio."""
    training, *prior = [bool(getattr(part, "audio", False)) for part, _ in _parts(dataset, where)]
    if prior and prior[0] != training:
        raise ValueError(f"data.prior_manifest: {'the prior items' if training else 'the training items'} carry no "
                         "audio latents and the others do; a batch needs audio for every item or none (cache both "
                         "sets with the audio VAE, or neither)")
    from ..models.base import UnsupportedSetting
    if training and not getattr(family, "takes_audio", False):
        raise UnsupportedSetting(f"{where}: its clips carry audio latents, and {family.display_name} takes no audio "
                                 "stream (LTX-2 and MiniMax H3 do); cache the clips without the audio VAE")
    if not training and getattr(family, "needs_audio", False):  # its model always generates both streams
        raise UnsupportedSetting(f"{where}: {family.display_name} generates video with sound, and these items carry "
                                 "no audio latents: cache clips with sound, with the model's audio VAE connected to "
                                 "Cache Latents' audio_vae")


def _check_text_extras(dataset, family, where: str):
    """A cached dataset's captions carry the text encoder's extras the family's model needs (the graph's
    TrainingDataset holds no embeddings: the trainer checks its cache at start-up)."""
    needed = getattr(family, "text_extras_needed", ())
    for part, name in _parts(dataset, where):
        if needed and hasattr(part, "text") and len(part) > 0:
            missing = [n for n in needed if TEXT_EXTRA + n not in part.text(0)]
            if missing:
                raise ValueError(f"{name}: {family.display_name} is conditioned on its text encoder's "
                                 f"{', '.join(missing)} beside the embedding, which the cached captions lack: encode "
                                 "them with the model's own text encoder (its CLIP loader) in Cache Text Embeddings")


def check_eval_references(dataset, eval_dataset, family=None,
                          where: str = "data.eval_manifest (the eval_dataset input)"):
    """Fails at start-up where the evaluation set's items carry another number of reference images than the
    training set's, or sound where the training clips have none (or the other way round): a model trained on edit
    pairs, start images or sound, evaluated without them, would be measured at a task it is not trained for."""
    train_slots, eval_slots = reference_slots(dataset), reference_slots(eval_dataset)
    if family is not None:
        check_dataset_for_family(eval_dataset, family, where)
    if eval_slots != train_slots:
        have = f"{eval_slots} reference image(s)" if eval_slots else "no reference images"
        raise ValueError(f"{where}: its items carry {have}, the training items {train_slots}; evaluate on images "
                         "with the same reference images as the training images (name.ref.png beside each, or a "
                         "reference folder), or leave the evaluation set out to evaluate the training images")
    if has_audio(eval_dataset) != has_audio(dataset):  # the loss of another task: both streams, or video alone
        raise ValueError(f"{where}: its clips' sound was {'' if has_audio(eval_dataset) else 'not '}cached, the "
                         f"training clips' was {'not ' if has_audio(eval_dataset) else ''}(Cache Latents' audio_vae); "
                         "cache both sets the same way, or leave the evaluation set out")


def text_inputs_beside_the_embedding(family, dataset) -> str:
    """What the dataset's captions carry beside the embedding and pooled vector that the family's model is given,
    in words ("" where nothing): the text encoder's attention mask where the family reads it (Batch.text_mask), and
    its extra outputs (Batch.text_extras). Pipeline stages and distillation's networks pass on neither."""
    if len(dataset) == 0:
        return ""
    text = _parts(dataset, "")[0][0].text(0)
    what = ["attention mask"] if getattr(family, "reads_text_mask", False) and "attention_mask" in text else []
    # every caption's, not the first one's alone: HunyuanImage's glyph embedding comes with quoted text only
    what += sorted({name for part, _ in _parts(dataset, "") for signature, _ in _extras_signatures(part)
                    for name, _ in signature})
    return ", ".join(what)
