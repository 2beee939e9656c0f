"""What a diffusion-model file the pack writes (a materialised copy of the graph's MODEL, a full fine-tune) carries
beside its weights, so that ComfyUI's Load Diffusion Model builds the same model from it: the "config" metadata
that ComfyUI's detection reads what the weights do not say from (LTX-2's sizes, Wan's variants), as Lightricks'
and Wan's own files carry it."""
from __future__ import annotations

import json


def config_metadata(base_model, weights: dict | None = None) -> dict[str, str]:
    """{"config": ...} for a file of `weights` (default: the model's own) of ComfyUI's `base_model`, or {} where the
    weights alone load as the same class and settings (every SD, SDXL, Flux... file: nothing is written that no
    loader reads, and a copy keyed on its metadata stays the one written before). The settings written are those of
    the class's telling keys and of the model's config that detection from the weights alone gives otherwise, and
    that a file can carry (JSON)."""
    from comfy.model_detection import detect_unet_config, model_config_from_unet
    config = base_model.model_config
    weights = base_model.diffusion_model.state_dict() if weights is None else weights
    try:
        plain = model_config_from_unet(dict(weights), "")
        if type(plain) is type(config) and _settings(plain.unet_config) == _settings(config.unet_config):
            return {}
        detected = detect_unet_config(dict(weights), "") or {}
    except Exception:  # noqa: BLE001 - a model ComfyUI's detection cannot read: its file is written as before
        return {}
    differs = {k: v for k, v in {**config.unet_config, **type(config).unet_config}.items()
               if (k not in detected or detected[k] != v) and json.loads(json.dumps(v, default=repr)) == v}
    return {"config": json.dumps({"transformer": differs}, sort_keys=True)} if differs else {}


def _settings(unet_config: dict) -> dict:
    return {k: v for k, v in unet_config.items() if k != "dtype"}  # the loaded model's, which a file does not set
