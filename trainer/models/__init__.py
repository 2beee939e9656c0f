"""Model families behind one interface; `load_family` rebuilds a model with ComfyUI's own code."""
from __future__ import annotations

from .base import Batch, ModelFamily, UnsupportedSetting
from .flux import FluxFamily
from .generic import GenericFamily
from .sd3 import SD3Family
from .sd_unet import SDUNetFamily
from .sdxl import SDXLFamily
from .wan import WanFamily

# first match wins; the generic family takes any model no dedicated family claims
FAMILIES: list[type[ModelFamily]] = [SDUNetFamily, SDXLFamily, SD3Family, FluxFamily, WanFamily, GenericFamily]
SCRATCH_FAMILIES: dict[str, type[ModelFamily]] = {cls.name: cls for cls in FAMILIES if cls.scratch_sizes}


def detect_prediction(base_model) -> str:
    return prediction_from_sampling(base_model.model_sampling)


def prediction_from_sampling(sampling) -> str:
    """epsilon, v_prediction or flow, from a ComfyUI model_sampling object."""
    import comfy.model_sampling as ms
    if isinstance(sampling, ms.V_PREDICTION):
        return "v_prediction"
    if isinstance(sampling, ms.EPS):
        return "epsilon"
    if isinstance(sampling, ms.CONST):
        return "flow"
    raise ValueError(f"model: objective {type(sampling).__name__} is not supported "
                     "(epsilon, v-prediction and flow-matching models)")


def family_class(base_model, family: str = "auto") -> type[ModelFamily]:
    for cls in FAMILIES:
        if (family == "auto" and cls.matches(base_model)) or family == cls.name:
            return cls
    raise ValueError(f"model.family: {family!r} is not one of auto, {', '.join(c.name for c in FAMILIES)}")


def family_for(base_model, family: str = "auto", prediction: str = "auto", patcher=None) -> ModelFamily:
    if prediction == "auto":
        prediction = detect_prediction(base_model)
    return family_class(base_model, family)(base_model, prediction, patcher)


def load_family(model_path: str, family: str = "auto", prediction: str = "auto") -> ModelFamily:
    import torch
    import comfy.sd
    patcher = comfy.sd.load_diffusion_model(model_path, model_options={"dtype": torch.float32})
    if patcher is None:
        raise ValueError(f"{model_path}: ComfyUI does not recognise this diffusion model")
    return family_for(patcher.model, family, prediction, patcher)


__all__ = ["Batch", "ModelFamily", "UnsupportedSetting", "FAMILIES", "SCRATCH_FAMILIES", "load_family",
           "family_for", "family_class", "detect_prediction",
           "prediction_from_sampling"]
