"""The text-embedding cache key (cache/encoding.py clip_identity) is the same for every load of the same text encoder
file, though ComfyUI leaves the weights a file lacks uninitialised (SD1.5 and SDXL checkpoints have no CLIP-L text
projection), and changes with any weight the encoding reads. Unit tests on tiny CLIPs built by ComfyUI's own classes
and loaded by its own load_sd; no server."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.comfyui

# ComfyUI's CLIP text model at the smallest size its layer settings allow (SDXL reads the penultimate layer)
TINY_CLIP = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_hidden_layers": 3,
             "projection_dim": 16}


def _comfy():
    sys.path.insert(0, str(REPO))
    from tools.bootstrap import bootstrap
    bootstrap()


def _encoder_classes(kind: str):
    import comfy.sd1_clip
    import comfy.sdxl_clip
    return {"sd1": (comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel),
            "sdxl": (comfy.sdxl_clip.SDXLTokenizer, comfy.sdxl_clip.SDXLClipModel)}[kind]


def _file_state(kind: str) -> dict:
    """A text encoder file as SD1.5 and SDXL checkpoints hold it: random weights, no CLIP-L text projection and no
    logit_scale (ComfyUI's own savers drop both)."""
    import comfy.sd
    import comfy.supported_models_base
    tokenizer, model = _encoder_classes(kind)
    g = torch.Generator().manual_seed(0)
    built = comfy.sd.CLIP(comfy.supported_models_base.ClipTarget(tokenizer, model), model_options=_options())
    return {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in built.cond_stage_model.state_dict().items()
            if k != "clip_l.transformer.text_projection.weight" and not k.endswith("logit_scale")}


def _options() -> dict:
    return {"clip_l_model_config": TINY_CLIP, "clip_g_model_config": TINY_CLIP}


def _load(kind: str, state: dict):
    """What a CLIP or checkpoint loader gives: ComfyUI's CLIP built, then the file's weights loaded (strict=False)."""
    import comfy.sd
    import comfy.supported_models_base
    tokenizer, model = _encoder_classes(kind)
    clip = comfy.sd.CLIP(comfy.supported_models_base.ClipTarget(tokenizer, model), model_options=_options())
    missing, _ = clip.load_sd(dict(state), full_model=True)
    assert "clip_l.transformer.text_projection.weight" in missing
    return clip


@pytest.mark.parametrize("kind, read_weight", [
    ("sd1", "clip_l.transformer.text_model.final_layer_norm.weight"),
    ("sdxl", "clip_g.transformer.text_projection.weight"),  # shapes SDXL's pooled vector: read
])
def test_text_key_is_the_files_not_the_uninitialised_memory(kind, read_weight):
    _comfy()
    from ingraph_trainer.cache.encoding import clip_identity, text_key
    state = _file_state(kind)
    first, second = _load(kind, state), _load(kind, state)
    # what a second load may find in the memory ComfyUI leaves uninitialised
    for clip, value in ((first, 1.0), (second, -3.0)):
        clip.cond_stage_model.clip_l.transformer.text_projection.weight.data.fill_(value)
        clip.cond_stage_model.clip_l.logit_scale.data.fill_(value)
    assert text_key("a photo", clip_identity(first)) == text_key("a photo", clip_identity(second))

    changed = _load(kind, {**state, read_weight: state[read_weight] + 0.01})
    assert clip_identity(changed) != clip_identity(first)


def test_a_projection_is_unread_only_where_the_encoder_drops_its_output():
    """SDXL returns CLIP-G's projected pooled vector and drops CLIP-L's, though both models compute theirs."""
    _comfy()
    from ingraph_trainer.cache.encoding import unread_text_weights
    clip = _load("sdxl", _file_state("sdxl"))
    assert unread_text_weights(clip) == {"clip_l.logit_scale", "clip_g.logit_scale",
                                         "clip_l.transformer.text_projection.weight"}


def test_ltxv_text_encoders_attention_mask_is_cached_beside_the_embedding_and_batched(tmp_path):
    """ComfyUI's LTX-Video text encoder (T5, padded to 128 tokens) returns its attention mask beside the embedding;
    the cache stores it in the text entry (its key says so) and the trainer's batches carry it (Batch.text_mask),
    repeated as the embedding is where caption lengths differ."""
    _comfy()
    import comfy.sd
    import comfy.supported_models_base
    import comfy.text_encoders.lt

    from ingraph_trainer.cache.encoding import clip_identity
    from ingraph_trainer.trainer.data.batch_mix import training_batch
    from media_files import cached_captions

    tiny_t5 = {"d_ff": 32, "d_kv": 8, "d_model": 16, "num_heads": 2, "num_layers": 1}
    clip = comfy.sd.CLIP(comfy.supported_models_base.ClipTarget(comfy.text_encoders.lt.LTXVT5Tokenizer,
                                                                 comfy.text_encoders.lt.ltxv_te()),
                         model_options={"t5xxl_model_config": tiny_t5})
    g = torch.Generator().manual_seed(0)
    for p in clip.cond_stage_model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    # 4 tokens padded to 128, and 256 tokens (T5 gives "cat" one token, then its end token): no padding
    captions = {"short": "a cat", "long": " ".join(["cat"] * 255)}
    _, cached, by_name = cached_captions(tmp_path, clip, captions, video=True)
    manifest = str(tmp_path / "m.json")
    expected = {name: clip.encode_from_tokens(clip.tokenize(captions[name]),
                                              return_dict=True)["attention_mask"][0] for name in by_name}
    assert expected["short"].sum() < 128 == len(expected["short"]) and expected["long"].all()
    for name, i in by_name.items():
        assert torch.equal(cached.text(i)["attention_mask"], expected[name])
    batch = training_batch(cached, [by_name["short"], by_name["long"]])
    tokens = batch.cond.shape[1]
    assert batch.text_mask.shape == (2, tokens) and tokens == 256
    assert torch.equal(batch.text_mask[0], expected["short"].repeat(tokens // 128))
    assert torch.equal(cached.text_masks([by_name["short"]])[0], expected["short"])
    # the key of an encoder returning its mask differs from the one of entries cached without it
    clip.cond_stage_model.t5xxl.return_attention_masks = False
    without = clip_identity(clip)
    clip.cond_stage_model.t5xxl.return_attention_masks = True
    assert clip_identity(clip) != without
    # pipeline stages do not carry the mask: LTX-Video, which reads it, is refused them at start
    from types import SimpleNamespace

    from ingraph_trainer.trainer.data.batch_mix import build_training_data
    from ingraph_trainer.trainer.models.ltxv import LTXVFamily
    spec = SimpleNamespace(manifest=manifest, prior_manifest=None, shuffle=True, caption_dropout=0.0)
    ltxv = SimpleNamespace(display_name="LTX-Video", reference_input=None, reads_text_mask=LTXVFamily.reads_text_mask,
                           read_dataset=lambda dataset: None, latent_channels=4, latent_ndim=5)
    assert build_training_data(spec, 2, 0, ltxv)[0] is not None
    with pytest.raises(ValueError, match="attention mask, which LTX-Video reads and pipeline stages"):
        build_training_data(spec, 2, 0, ltxv, pipeline_stages=2)
