"""Any other diffusion model ComfyUI loads: adapters on its linear layers, conditioning from ComfyUI's
own extra_conds, the objective from its model_sampling (epsilon, v-prediction, CogVideoX's v-prediction or flow).

It trains what ComfyUI's sampler would run with what CLIPTextEncode gives: the text embedding, the pooled vector
where the model takes one, and the encoder's other outputs (HunyuanDiT's mT5 embedding, Anima's T5 token ids); inputs
a model needs beyond those (reference images, masks) are left at ComfyUI's defaults.
"""
from __future__ import annotations

import torch

from .base import ModelFamily, UnsupportedSetting, block_lists, is_comfy_model
from .hunyuan_video import refuse_mean_flow
from .residuals import residuals_out_of_place

# AuraFlow names its projections w1q..w2o (text and image streams) and c_fc1/c_fc2/c_proj; Kandinsky 5 its
# to_query/to_key/to_value/out_layer and its feed-forward in_layer/out_layer; JoyImage's joint attention is one
# module holding each stream's layers (attn.img_attn_qkv, ...); Cosmos Predict2 names its attention's output
# output_proj and its feed-forward layer1/layer2
ATTENTION = (r"(attn|attention)[^.]*\.(to_q|to_k|to_v|to_out\.0|q|k|v|o|qkv|proj|out|q_proj|k_proj|v_proj|o_proj"
             r"|output_proj|w[12][qkvo]|to_query|to_key|to_value|out_layer)$", r"attn\.(img|txt)_attn_(qkv|proj)$",
             r"^blocks\.\d+\.(q|k|v|attn_out)$")  # CogVideoX's blocks hold their attention's layers
# (not an adaLN modulation's MLP, such as Cosmos Predict2's adaln_modulation_mlp: it conditions on the timestep)
FEED_FORWARD = (r"(?<!modulation_)(mlp|ffn|ff|feed_forward)[^.]*\.(\d+|fc[12]|w[123]|net\.0\.proj|net\.2|proj"
                r"|linear[12]|layer[12]|c_fc[12]|c_proj|in_layer|out_layer)$", r"^blocks\.\d+\.ff_(proj|out)$")


# the text encoder's extras (Batch.text_extras) some of ComfyUI's model classes cannot run without: HunyuanDiT's
# (1.0's too) mT5 embedding and its mask; Anima's T5 token ids and weights, which its LLM adapter reads with the
# Qwen3 embedding
TEXT_EXTRAS_NEEDED = {"HunyuanDiT": ("conditioning_mt5xl", "attention_mask_mt5xl"),
                      "Anima": ("t5xxl_ids", "t5xxl_weights")}


class GenericFamily(ModelFamily):
    name = "generic"
    display_name = "generic"
    target_patterns = {"attention": ATTENTION, "attention_ff": ATTENTION + FEED_FORWARD}

    def __init__(self, base_model, prediction: str, patcher=None):
        super().__init__(base_model, prediction, patcher)
        for class_name, needed in TEXT_EXTRAS_NEEDED.items():
            if is_comfy_model(base_model, class_name):
                self.text_extras_needed = needed
        # HunyuanDiT's extra_conds makes its CLIP text's mask from the encoder's attention mask, as LTX-Video's
        self.reads_text_mask = is_comfy_model(base_model, "HunyuanDiT")
        self.anima = is_comfy_model(base_model, "Anima")
        self.display_name = f"generic ({type(base_model.model_config).__name__})"
        self.base_model_version = type(base_model.model_config).__name__.lower()
        # a video class (its latent format has a frame axis) takes B C T H W, as its video VAE gives them (an image
        # one frame); an image VAE's latents are refused for it (dataset_checks)
        if getattr(base_model.latent_format, "latent_dimensions", 2) == 3:
            self.latent_ndim = 5

    @classmethod
    def matches(cls, base_model) -> bool:
        return True

    def check_settings(self, spec) -> None:
        refuse_mean_flow(self)  # HunyuanImage 2.1's distilled release
        super().check_settings(spec)
        if self.anima and spec.train.batch_size > 1:
            raise UnsupportedSetting("train.batch_size: Anima's captions each have their own number of T5 tokens, "
                                     "which ComfyUI conditions one caption at a time: train with batch_size 1 and use "
                                     "gradient_accumulation for a larger batch")

    def prepare_for_training(self) -> None:
        super().prepare_for_training()
        # models built from ComfyUI's Flux blocks that no Flux-layout family takes (LongCat-Image, HunyuanImage 2.1):
        # their blocks add residuals in place, as the flux and hunyuan_video families' own
        flux_blocks = [b for b in block_lists(self.diffusion_model) if type(b).__module__ == "comfy.ldm.flux.layers"]
        residuals_out_of_place(flux_blocks)

    def extra_cond_inputs(self, batch, x_noisy: torch.Tensor) -> dict:
        inputs = super().extra_cond_inputs(batch, x_noisy)
        if any(is_comfy_model(self.base_model, name) for name in ("Omnigen2", "Boogu")):
            # their extra_conds make the model's num_tokens from the text's attention mask, as Lumina 2's do
            inputs["attention_mask"] = self.whole_text_mask(batch, x_noisy.device)
        if self.anima:  # given to the model in model_kwargs: extra_conds takes them one caption at a time
            for name in self.text_extras_needed:
                inputs.pop(name, None)
        return inputs

    def model_kwargs(self, batch, x_noisy: torch.Tensor, dtype) -> dict:
        out = super().model_kwargs(batch, x_noisy, dtype)
        if self.anima:
            # what ComfyUI 0.33's Anima.extra_conds hands a model that trains (grad on), for the whole batch: the T5
            # token ids [B, tokens] and their weights [B, tokens, 1], which its forward runs the LLM adapter on
            extras = batch.text_extras or {}
            out["t5xxl_ids"] = extras["t5xxl_ids"].to(x_noisy.device)
            out["t5xxl_weights"] = extras["t5xxl_weights"].unsqueeze(-1).to(x_noisy.device, dtype)
        return out

    def transformer_options(self, kwargs: dict) -> dict:
        if is_comfy_model(self.base_model, "LongCatImage"):  # its _apply_model shifts the rotary positions by the
            text = kwargs.get("context")  # text's length (ComfyUI 0.33's model_base.LongCatImage)
            length = float(text.shape[1]) if text is not None else 512.0
            return {"rope_options": {"shift_t": 1.0, "shift_y": length, "shift_x": length}}
        return {}

    def image_size_problem(self, width: int, height: int) -> str | None:
        model = self.diffusion_model
        if type(model).__name__ == "PixArtMS" and (model.pe_interpolation is None or model.pe_precision is not None):
            # its forward scales the position embedding by round(((H + W) // 2) / 64) of the latent's sides (a
            # VAE's 8x), and divides by that: zero below an average side of 264 px (Python rounds 0.5 to 0)
            c_res = (width // 8 + height // 8) // 2
            if round(c_res / 64.0, model.pe_precision or 0) == 0:
                return ("ComfyUI's PixArt computes its position embedding from the latent's size, which fails "
                        "below an average side of 264 px (width + height at least 528); load the images at a "
                        "larger resolution")
        return None

    def checkpoint_blocks(self):
        blocks = block_lists(self.diffusion_model)
        if not blocks:
            raise ValueError(f"{self.display_name}: no block list found for gradient checkpointing; turn it off")
        return blocks
