"""Model families behind one interface; `load_family` rebuilds a model with ComfyUI's own code."""
from __future__ import annotations

from .base import Batch, ModelFamily
from .sd_unet import SDUNetFamily

FAMILIES: list[type[ModelFamily]] = [SDUNetFamily]


def detect_prediction(base_model) -> str:
    import comfy.model_base
    return "v_prediction" if base_model.model_type == comfy.model_base.ModelType.V_PREDICTION else "epsilon"


def load_family(model_path: str, family: str = "auto", prediction: str = "auto") -> ModelFamily:
    import torch
    import comfy.sd
    patcher = comfy.sd.load_diffusion_model(model_path, model_options={"dtype": torch.float32})
    if patcher is None:
        raise ValueError(f"{model_path}: ComfyUI does not recognise this diffusion model")
    base_model = patcher.model
    if prediction == "auto":
        prediction = detect_prediction(base_model)
    for cls in FAMILIES:
        if (family == "auto" and cls.matches(base_model)) or family == cls.name:
            return cls(base_model, prediction, patcher)
    raise ValueError(f"{model_path}: no trainer family for ComfyUI model {type(base_model.model_config).__name__} "
                     f"(supported: {', '.join(c.name for c in FAMILIES)})")


__all__ = ["Batch", "ModelFamily", "FAMILIES", "load_family", "detect_prediction"]
