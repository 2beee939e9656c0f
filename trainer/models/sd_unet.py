"""SD1.x / SD2.x UNets: epsilon or v-prediction on ComfyUI's discrete schedule."""
from __future__ import annotations

import torch

from .base import Batch, ModelFamily


class SDUNetFamily(ModelFamily):
    name = "sd_unet"
    target_patterns = {
        "attention": (r"\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$",),
        "attention_ff": (r"\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$", r"\.ff\.net\.(0\.proj|2)$"),
    }

    def __init__(self, base_model, prediction: str, patcher=None):
        super().__init__(base_model, prediction, patcher)
        name = type(base_model.model_config).__name__
        self.base_model_version = {"SD15": "sd_v1", "SD20": "sd_v2", "SD21UnclipL": "sd_v2",
                                   "SD21UnclipH": "sd_v2"}.get(name, name.lower())

    @classmethod
    def matches(cls, base_model) -> bool:
        from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
        config = base_model.model_config.unet_config
        return isinstance(base_model.diffusion_model, UNetModel) and config.get("adm_in_channels") is None \
            and not config.get("use_temporal_resblock", False)

    def checkpoint_blocks(self):
        unet = self.diffusion_model
        return [*unet.input_blocks, *unet.middle_block, *unet.output_blocks]

    def loss(self, batch: Batch, reduce: bool = True, weighted: bool = True) -> torch.Tensor:
        sampling = self.base_model.model_sampling
        dtype = next(self.diffusion_model.parameters()).dtype
        x0 = self.prepare_latents(batch.latents.float())
        # discrete timestep index from the fraction, and its sigma on ComfyUI's own schedule
        t = (batch.timesteps * len(sampling.sigmas)).long().clamp(0, len(sampling.sigmas) - 1)
        sigma = sampling.sigmas[t].to(x0.device).float().view(-1, 1, 1, 1)
        noise = batch.noise.float()
        x_noisy = x0 + noise * sigma
        x_in = x_noisy / (sigma ** 2 + 1.0).sqrt()
        out = self.diffusion_model(x_in.to(dtype), t.float(), context=batch.cond.to(dtype))
        if self.prediction == "v_prediction":
            target = (noise - sigma * x0) / (sigma ** 2 + 1.0).sqrt()
        else:
            target = noise
        snr = 1.0 / sigma.view(-1) ** 2  # alpha_bar / (1 - alpha_bar) on ComfyUI's schedule
        per_sample = self.training_loss(out, target, snr, weighted)
        return per_sample.mean() if reduce else per_sample
