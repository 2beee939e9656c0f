"""Krea 2 (ComfyUI 0.33's `Krea2`): a single-stream DiT on the Wan 2.1 VAE's latents (images as one-frame videos,
B C 1 H W), conditioned on the hidden states of several Qwen3-VL layers side by side (ComfyUI hands them as one
tensor, tokens x layers*width), which its own text-fusion transformer mixes. Rectified flow.

ComfyUI 0.3.64 has no Krea 2: there this family matches nothing and builds nothing."""
from __future__ import annotations

from .base import ModelFamily, random_state_dict, is_comfy_model

ATTENTION = (r"blocks\.\d+\.attn\.(wq|wk|wv|wo|gate)$",)
FEED_FORWARD = (r"blocks\.\d+\.mlp\.(gate|up|down)$",)


class Krea2Family(ModelFamily):
    name = "krea2"
    display_name = "Krea 2"
    base_model_version = "krea2"
    latent_ndim = 5
    # the image blocks only: the text-fusion blocks (txtfusion.*) share the names but mix the encoder's layers
    target_patterns = {"attention": tuple("^" + p for p in ATTENTION),
                       "attention_ff": tuple("^" + p for p in ATTENTION + FEED_FORWARD)}
    # ComfyUI reads the widths, depths and head counts from the weights (heads 128 wide; the text fusion's 20 heads
    # fixed): one block of one head, text from 2 encoder layers 160 wide
    scratch_sizes = {"tiny": dict(features=128, layers=1, txtlayers=2, txtdim=160)}

    @classmethod
    def matches(cls, base_model) -> bool:
        return is_comfy_model(base_model, "Krea2")

    def checkpoint_blocks(self):
        return list(self.diffusion_model.blocks)

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, features: int = 128, layers: int = 1, txtlayers: int = 2,
                           txtdim: int = 160, **_):
        import comfy.ops
        from comfy.ldm.krea2.model import SingleStreamDiT
        heads = features // 128
        model = SingleStreamDiT(features=features, heads=heads, kvheads=heads, layers=layers, channels=16,
                                txtlayers=txtlayers, txtdim=txtdim, operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)
