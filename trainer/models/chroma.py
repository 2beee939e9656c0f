"""Chroma: a Flux-shaped DiT without the pooled CLIP vector or per-block modulation layers (one shared "distilled
guidance" network gives every block its modulation), conditioned on T5 text alone. ComfyUI runs it with guidance 0
unless a conditioning sets one, and so does training."""
from __future__ import annotations

import torch

from .base import ModelFamily, UnsupportedSetting, random_state_dict
from .flux import ATTENTION, FEED_FORWARD
from .stages import StageInput, ends_here


class ChromaFamily(ModelFamily):
    name = "chroma"
    text_input_layer = r"^txt_in$"
    display_name = "Chroma"
    base_model_version = "chroma"
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}

    @classmethod
    def matches(cls, base_model) -> bool:
        """Chroma, and Chroma Radiance where it is built of Chroma's blocks (ComfyUI 0.3.64; 0.33's has Flux's,
        which the generic family trains as they are)."""
        import comfy.model_base
        if type(base_model) is comfy.model_base.Chroma:
            return True
        blocks = getattr(getattr(base_model, "diffusion_model", None), "double_blocks", ())
        return (isinstance(base_model, comfy.model_base.Chroma) and len(blocks) > 0
                and all(type(b).__module__ == "comfy.ldm.chroma.layers" for b in blocks))

    def checkpoint_blocks(self):
        return [*self.diffusion_model.double_blocks, *self.diffusion_model.single_blocks]

    def pipeline_layers(self):
        import comfy.model_base
        if type(self.base_model) is not comfy.model_base.Chroma:  # ComfyUI 0.3.64's Chroma Radiance: pixel space
            raise UnsupportedSetting("distributed.pipeline_stages: Chroma Radiance does not split into pipeline "
                                     "stages yet (its pixel decoder needs the image itself after the blocks); use 1 "
                                     "stage")
        model = self.diffusion_model
        singles = [n for n in range(len(model.single_blocks)) if n not in model.skip_dit]  # what forward_orig runs
        return [ChromaBegin(self),
                *(ChromaDoubleBlock(b, n, model.params) for n, b in enumerate(model.double_blocks)
                  if n not in model.skip_mmdit),
                *(ChromaSingleBlock(model.single_blocks[n], n, model.params, first=n == singles[0]) for n in singles),
                ChromaEnd(self, join=not singles)]

    def prepare_for_training(self) -> None:
        """ComfyUI's Chroma blocks add their residuals with `addcmul_` into tensors their norms saved for the
        backward pass (and return the same tensor), which autograd refuses: the trainer's copy runs each block's
        own computation with the residual added out of place (the same operation, the same values)."""
        import types
        super().prepare_for_training()
        for block in self.diffusion_model.double_blocks:
            block.forward = types.MethodType(_double_block_forward, block)
        for block in self.diffusion_model.single_blocks:
            block.forward = types.MethodType(_single_block_forward, block)

    def check_settings(self, spec) -> None:
        super().check_settings(spec)
        if spec.train.guidance != 1.0:
            raise UnsupportedSetting("train.guidance: Chroma runs with ComfyUI's default guidance (0) as its "
                                     "samplers do; leave guidance at 1")

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, depth: int = 1, depth_single_blocks: int = 0, **_):
        """ComfyUI fixes Chroma's width (3072, 24 heads, 4096-wide text) and its 5-layer 5120-wide modulation
        network (278M parameters); only the block depths are free, and detection needs one double block."""
        import comfy.ops
        from comfy.ldm.chroma.model import Chroma, ChromaParams
        from ..comfy_compat import build_dit
        model = build_dit(
            Chroma, ChromaParams, in_channels=64, out_channels=64, in_dim=64, out_dim=3072, hidden_dim=5120,
            n_layers=5, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=depth,
            depth_single_blocks=depth_single_blocks, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
            operations=comfy.ops.disable_weight_init)
        return random_state_dict(model, seed)


class ChromaBegin(StageInput):
    """Stage input: Chroma._forward and forward_orig up to the blocks. The one modulation network ("distilled
    guidance") runs here, once, as in forward_orig; its output for every block crosses the stages, and each block
    takes its slices there (ComfyUI's get_modulations). Tuple out: (img, txt, pe, modulations, shape) with shape =
    (height, width) of the latent."""

    def __init__(self, family):
        super().__init__(family)
        model = family.diffusion_model
        self.img_in, self.txt_in = model.img_in, model.txt_in
        self.distilled_guidance_layer = model.distilled_guidance_layer

    def forward(self, inputs):
        from comfy.ldm.chroma.model import timestep_embedding
        from comfy.ldm.common_dit import pad_to_patch_size
        from einops import rearrange, repeat
        model = self.family.diffusion_model
        x, timesteps, kwargs = self.model_inputs(inputs)
        context, guidance = kwargs["context"], kwargs["guidance"]
        bs, _, h, w = x.shape
        p = model.patch_size
        img = rearrange(pad_to_patch_size(x, (p, p)), "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=p, pw=p)
        h_len, w_len = (h + p // 2) // p, (w + p // 2) // p
        img_ids = torch.zeros((h_len, w_len, 3), device=x.device, dtype=x.dtype)
        img_ids[:, :, 1] += torch.linspace(0, h_len - 1, steps=h_len, device=x.device, dtype=x.dtype).unsqueeze(1)
        img_ids[:, :, 2] += torch.linspace(0, w_len - 1, steps=w_len, device=x.device, dtype=x.dtype).unsqueeze(0)
        img_ids = repeat(img_ids, "h w c -> b (h w) c", b=bs)
        txt_ids = torch.zeros((bs, context.shape[1], 3), device=x.device, dtype=x.dtype)
        img = self.img_in(img)
        length = 344  # forward_orig's mod_index_length
        distill_timestep = timestep_embedding(timesteps.detach().clone(), 16).to(img.device, img.dtype)
        distil_guidance = timestep_embedding(guidance.detach().clone(), 16).to(img.device, img.dtype)
        index = timestep_embedding(torch.arange(length, device=img.device), 32).to(img.device, img.dtype)
        index = index.unsqueeze(0).repeat(img.shape[0], 1, 1).to(img.device, img.dtype)
        timestep_guidance = torch.cat([distill_timestep, distil_guidance], dim=1).unsqueeze(1).repeat(
            1, length, 1).to(img.dtype).to(img.device, img.dtype)
        modulations = self.distilled_guidance_layer(torch.cat([timestep_guidance, index], dim=-1).to(img.device,
                                                                                                   img.dtype))
        txt = self.txt_in(context)
        pe = model.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        return (*self.sendable(img, txt, pe, modulations), torch.tensor([h, w], device=x.device))


def _modulation(params, modulations, kind: str, index: int = 0):
    """ComfyUI's get_modulations, which reads the model's depths alone (its `params`): the layers do not hold
    the model."""
    import types
    from comfy.ldm.chroma.model import Chroma
    return Chroma.get_modulations(types.SimpleNamespace(params=params), modulations, kind, idx=index)


class ChromaDoubleBlock(torch.nn.Module):
    def __init__(self, block, index: int, params):
        super().__init__()
        self.block, self.index, self.params = block, index, params

    def forward(self, inputs):
        img, txt, pe, modulations, shape = inputs
        vec = (_modulation(self.params, modulations, "double_img", self.index),
               _modulation(self.params, modulations, "double_txt", self.index))
        img, txt = self.block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=None, transformer_options={})
        return img, txt, pe, modulations, shape


def _joined(inputs):
    """Double-block tuples (img, txt, pe, modulations, shape) become single-block ones (txt+img, pe, modulations,
    shape, txt_len)."""
    img, txt, pe, modulations, shape = inputs
    return torch.cat((txt, img), 1), pe, modulations, shape, torch.tensor([txt.shape[1]], device=shape.device)


class ChromaSingleBlock(torch.nn.Module):
    def __init__(self, block, index: int, params, first: bool):
        super().__init__()
        self.block, self.index, self.params, self.first = block, index, params, first

    def forward(self, inputs):
        img, pe, modulations, shape, txt_len = _joined(inputs) if self.first else inputs
        vec = _modulation(self.params, modulations, "single", self.index)
        return self.block(img, vec=vec, pe=pe, attn_mask=None, transformer_options={}), pe, modulations, shape, txt_len


class ChromaEnd(torch.nn.Module):
    def __init__(self, family, join: bool):
        super().__init__()
        model = family.diffusion_model
        self.final_layer, self.patch_size, self.params = model.final_layer, model.patch_size, model.params
        self.join = join  # no single block runs (else the first one joined the streams)

    def forward(self, inputs):
        from einops import rearrange
        img, pe, modulations, shape, txt_len = _joined(inputs) if self.join else inputs
        h, w = shape.tolist()
        p = self.patch_size
        h_len, w_len = (h + p // 2) // p, (w + p // 2) // p
        img = self.final_layer(img[:, int(txt_len):, ...], vec=_modulation(self.params, modulations, "final"))
        out = rearrange(img, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=h_len, w=w_len, ph=p, pw=p)[:, :, :h, :w]
        return ends_here(out, pe)


# comfy/ldm/chroma/layers.py (ComfyUI 0.3.64) DoubleStreamBlock.forward and SingleStreamBlock.forward, each
# `a.addcmul_(g, b)` written as `a = torch.addcmul(a, g, b)`
def _double_block_forward(self, img, txt, pe, vec, attn_mask=None, transformer_options={}):
    from comfy.ldm.flux.math import attention
    (img_mod1, img_mod2), (txt_mod1, txt_mod2) = vec
    img_modulated = torch.addcmul(img_mod1.shift, 1 + img_mod1.scale, self.img_norm1(img))
    img_qkv = self.img_attn.qkv(img_modulated)
    img_q, img_k, img_v = img_qkv.view(img_qkv.shape[0], img_qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
    img_q, img_k = self.img_attn.norm(img_q, img_k, img_v)
    txt_modulated = torch.addcmul(txt_mod1.shift, 1 + txt_mod1.scale, self.txt_norm1(txt))
    txt_qkv = self.txt_attn.qkv(txt_modulated)
    txt_q, txt_k, txt_v = txt_qkv.view(txt_qkv.shape[0], txt_qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
    txt_q, txt_k = self.txt_attn.norm(txt_q, txt_k, txt_v)
    attn = attention(torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2),
                     torch.cat((txt_v, img_v), dim=2), pe=pe, mask=attn_mask, transformer_options=transformer_options)
    txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]
    img = torch.addcmul(img, img_mod1.gate, self.img_attn.proj(img_attn))
    img = torch.addcmul(img, img_mod2.gate,
                        self.img_mlp(torch.addcmul(img_mod2.shift, 1 + img_mod2.scale, self.img_norm2(img))))
    txt = torch.addcmul(txt, txt_mod1.gate, self.txt_attn.proj(txt_attn))
    txt = torch.addcmul(txt, txt_mod2.gate,
                        self.txt_mlp(torch.addcmul(txt_mod2.shift, 1 + txt_mod2.scale, self.txt_norm2(txt))))
    if txt.dtype == torch.float16:
        txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
    return img, txt


def _single_block_forward(self, x, pe, vec, attn_mask=None, transformer_options={}):
    from comfy.ldm.flux.math import attention
    mod = vec
    x_mod = torch.addcmul(mod.shift, 1 + mod.scale, self.pre_norm(x))
    qkv, mlp = torch.split(self.linear1(x_mod), [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
    q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = self.norm(q, k, v)
    attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
    output = self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
    x = torch.addcmul(x, mod.gate, output)
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x
