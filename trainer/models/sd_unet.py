"""SD1.x / SD2.x UNets: epsilon or v-prediction on ComfyUI's discrete schedule."""
from __future__ import annotations

from .base import ModelFamily

UNET_ATTENTION = (r"\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$",)
UNET_FEED_FORWARD = (r"\.ff\.net\.(0\.proj|2)$",)


def is_unet(base_model) -> bool:
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    return isinstance(base_model.diffusion_model, UNetModel) \
        and not base_model.model_config.unet_config.get("use_temporal_resblock", False)


class SDUNetFamily(ModelFamily):
    name = "sd_unet"
    display_name = "SD1.x/SD2.x UNet"
    diffusers_format = True
    target_patterns = {"attention": UNET_ATTENTION, "attention_ff": UNET_ATTENTION + UNET_FEED_FORWARD}

    def __init__(self, base_model, prediction: str, patcher=None):
        super().__init__(base_model, prediction, patcher)
        name = type(base_model.model_config).__name__
        self.base_model_version = {"SD15": "sd_v1", "SD20": "sd_v2", "SD21UnclipL": "sd_v2",
                                   "SD21UnclipH": "sd_v2"}.get(name, name.lower())

    @classmethod
    def matches(cls, base_model) -> bool:
        return is_unet(base_model) and base_model.model_config.unet_config.get("adm_in_channels") is None

    def checkpoint_blocks(self):
        unet = self.diffusion_model
        return [*unet.input_blocks, *unet.middle_block, *unet.output_blocks]
