"""Model families behind one interface; `load_family` rebuilds a model with ComfyUI's own code."""
from __future__ import annotations

import logging

from .base import Batch, ModelFamily, UnsupportedSetting
from .chroma import ChromaFamily
from .flux import FluxFamily
from .flux2 import Flux2Family
from .generic import GenericFamily
from .hunyuan_video import HunyuanVideo15Family, HunyuanVideoFamily
from .krea2 import Krea2Family
from .lumina2 import Lumina2Family
from .minimax_h3 import MiniMaxH3Family
from .ltxv import LTXVFamily
from .ltxav import LTXAVFamily
from .qwen_image import QwenImageFamily
from .sd3 import SD3Family
from .sd_unet import SDUNetFamily
from .sdxl import SDXLFamily
from .wan import WanFamily

# first match wins; the generic family takes any model no dedicated family claims
FAMILIES: list[type[ModelFamily]] = [SDUNetFamily, SDXLFamily, SD3Family, FluxFamily, Flux2Family, WanFamily,
                                     HunyuanVideoFamily, HunyuanVideo15Family, LTXVFamily, LTXAVFamily,
                                     QwenImageFamily, ChromaFamily, Lumina2Family, Krea2Family, MiniMaxH3Family,
                                     GenericFamily]
SCRATCH_FAMILIES: dict[str, type[ModelFamily]] = {cls.name: cls for cls in FAMILIES if cls.scratch_sizes}


def detect_prediction(base_model) -> str:
    return prediction_from_sampling(base_model.model_sampling)


def prediction_from_sampling(sampling) -> str:
    """epsilon, v_prediction, v_prediction_ddpm (CogVideoX's, ComfyUI 0.33's) or flow, from a ComfyUI model_sampling
    object."""
    import comfy.model_sampling as ms
    # objectives that subclass one below but are not it: EDM's output has the other sign (Cosmos 1), X0 and
    # IMG_TO_IMG predict the clean latent (Lotus), IMG_TO_IMG_FLOW starts from the clean latent (Wan FlowRVS)
    other = tuple(getattr(ms, name) for name in ("EDM", "X0", "IMG_TO_IMG_FLOW") if hasattr(ms, name))
    if isinstance(sampling, other):
        objective = next(c for c in type(sampling).__mro__[1:] if issubclass(c, other))  # IMG_TO_IMG, not its X0
        raise ValueError(f"model: objective {objective.__name__} is not "
                         "supported (epsilon, v-prediction, CogVideoX's v-prediction and flow-matching models)")
    if isinstance(sampling, ms.V_PREDICTION):
        return "v_prediction"
    if isinstance(sampling, getattr(ms, "V_PREDICTION_DDPM", ())):
        return "v_prediction_ddpm"
    if isinstance(sampling, ms.EPS):
        return "epsilon"
    if isinstance(sampling, (ms.CONST, getattr(ms, "COSMOS_RFLOW", ()))):  # Cosmos's: flow by its EDM sigma
        return "flow"
    raise ValueError(f"model: objective {type(sampling).__name__} is not supported "
                     "(epsilon, v-prediction, CogVideoX's v-prediction and flow-matching models)")


def family_class(base_model, family: str = "auto") -> type[ModelFamily]:
    check_family_name(family)
    for cls in FAMILIES:
        if (family == "auto" and cls.matches(base_model)) or family == cls.name:
            return cls
    raise ValueError("model.family: no family takes this model (the generic one takes any)")


def check_family_name(family: str) -> None:
    """model.family's one rule (the spec's own list of names once drifted from this one): auto or a family's name."""
    if family != "auto" and family not in {cls.name for cls in FAMILIES}:
        raise ValueError(f"model.family: {family!r} is not one of auto, {', '.join(c.name for c in FAMILIES)}")


def family_for(base_model, family: str = "auto", prediction: str = "auto", patcher=None) -> ModelFamily:
    if prediction == "auto":
        prediction = detect_prediction(base_model)
    return family_class(base_model, family)(base_model, prediction, patcher)


PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # train.precision → torch dtype


def loader_options(weight_dtype: str) -> dict:
    """ComfyUI's model_options for a UNETLoader weight_dtype, exactly as nodes.UNETLoader.load_unet maps it."""
    import torch
    if weight_dtype == "fp8_e4m3fn":
        return {"dtype": torch.float8_e4m3fn}
    if weight_dtype == "fp8_e4m3fn_fast":
        return {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
    if weight_dtype == "fp8_e5m2":
        return {"dtype": torch.float8_e5m2}
    if weight_dtype != "default":
        raise ValueError(f"model.weight_dtype: {weight_dtype!r} is not one of default, fp8_e4m3fn, "
                         "fp8_e4m3fn_fast, fp8_e5m2")
    return {}


def file_stamp(path: str) -> str:
    """"size:mtime_ns": how the run spec identifies a source file (no content hashing)."""
    import os
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


def check_stamps(model) -> None:
    """Refuses a source file that changed since the graph read it: the trainer would train other weights."""
    if not model.stamps:
        return
    for path, stamp in zip([model.path, *model.lora_paths], model.stamps):
        try:
            now = file_stamp(path)
        except OSError as exc:
            raise ValueError(f"model.stamps: {path} cannot be read ({exc.strerror}); queue the run again") from None
        if now != stamp:
            raise ValueError(f"model.stamps: {path} changed since the graph loaded it (size:mtime_ns {now}, the "
                             f"graph read {stamp}); queue the run again so it trains the file as it is now")


def base_storage_options(model, precision: str | None) -> dict:
    """model_options for the frozen base in the trainer: fp8 when the graph loaded it in fp8 (or base_precision
    asks for it); else the training precision, which is what the weights are computed in (fp32 when unknown:
    fp32 runs stay exact). A scaled-fp8 file keeps its fp8 linear weights either way (ComfyUI's ops)."""
    import torch
    options = loader_options(model.weight_dtype)
    if "dtype" not in options:
        if model.base_precision == "fp8":
            options["dtype"] = torch.float8_e4m3fn
        else:
            options["dtype"] = getattr(torch, PRECISION_DTYPES[precision or "fp32"])
    return options


def _as_model_spec(model, family: str, prediction: str):
    from ..spec import ModelSpec
    if isinstance(model, ModelSpec):
        return model
    return ModelSpec(path=str(model), family=family, prediction=prediction)


def load_base_model(model, precision: str | None = None, deferred=None):
    """ComfyUI's ModelPatcher for a run spec's model section: the source file loaded as its loader node loaded
    it (Load Checkpoint or Load Diffusion Model with its weight_dtype), then the upstream LoRAs applied in order
    with ComfyUI's own code and baked into the weights with ComfyUI's own patching code. The load peaks at about
    the weights held, not the weights plus the file (see loading.py).

    With `deferred` (a partitioned_load.DeferredWeights), the diffusion model's parameters are left unfilled where
    the model allows it (loading.why_not_deferred), their file tensors recorded in it for a ZeRO-3 partitioned load;
    its sources stay empty where they were filled as usual."""
    from ..comfy_compat import load_model_file
    from .loading import released_after_copy
    check_stamps(model)
    options = base_storage_options(model, precision)
    if model.format not in ("checkpoint", "diffusion_model"):
        raise ValueError(f"model.format: {model.format!r} is not one of diffusion_model, checkpoint")
    if deferred is not None and model.lora_paths:
        raise ValueError("a deferred load cannot bake the upstream LoRAs into weights it has not read")
    sources = deferred.sources if deferred is not None else None
    before_whole = deferred.before_whole_load if deferred is not None else None
    with released_after_copy(model.path, sources, before_whole) as released:  # the file's pages leave once copied
        patcher = load_model_file(model.path, from_checkpoint=model.format == "checkpoint", options=options)
    log = logging.getLogger(__name__)
    log.debug("%s: %.1f MiB of the file's pages dropped once copied into the model",
              model.path, released["released_bytes"] / 2**20)
    if deferred is not None and released.get("deferred"):
        log.info("%s: loaded whole, not into partitions: %s", model.path, released["deferred"])
    if patcher is None:
        raise ValueError(f"{model.path}: ComfyUI does not recognise this diffusion model")
    for path, strength in zip(model.lora_paths, model.lora_strengths):
        patcher = apply_lora(patcher, path, float(strength))
    bake_patches(patcher)
    return patcher


def apply_lora(patcher, path: str, strength: float):
    """Exactly what Load LoRA / LoraLoaderModelOnly do with the file: the graph's MODEL holds what ComfyUI's loader
    made of it, keys it skips included (a Train node's diffusers-layout output, which the node converts before
    applying, is never described as a file: runner/model_source.trained_output_source)."""
    from ..comfy_compat import load_tensors, with_lora
    return with_lora(patcher, load_tensors(path), strength)


def bake_patches(patcher) -> None:
    """Writes the patcher's weight patches into the weights, key by key, with ComfyUI's own patching code (the
    weight ComfyUI computes when it loads the patched model whole), and drops each original as soon as its
    patched weight replaces it, so no second copy of the model is ever held. Without autograd: the weights are
    parameters that require grad until the trainer freezes them, and ComfyUI's rounding of a patched fp8 weight
    (comfy/float.py, `clamp(out=...)`) refuses them otherwise, as it did for every fp8 base with a LoRA upstream
    (an Evaluate node on the trained LoRA, a run continuing from one)."""
    import uuid

    import torch
    with torch.no_grad():
        for key in list(patcher.patches):
            patcher.patch_weight_to_device(key, device_to=None)
            patcher.backup.pop(key, None)
    patcher.patches.clear()
    patcher.patches_uuid = uuid.uuid4()


# a standby's base model, loaded while the graph's earlier nodes ran (trainer/tasks/standby.py): [(load key, patcher)],
# taken by the run whose model and precision give the same key, dropped by any other
_preloaded: list = []


def load_key(model, precision: str | None) -> str:
    """What a base model's load depends on: the source files as stamped, how they are loaded, the precision."""
    import json
    return json.dumps([model.path, model.format, model.weight_dtype, model.base_precision, list(model.lora_paths),
                       [float(s) for s in model.lora_strengths], list(model.stamps), precision])


def preload_base_model(model, precision: str | None) -> None:
    """Loads the base model ahead of its run (a standby told what the queued prompt's Train node trains), in host
    memory, and keeps it for that run; a model preloaded before is dropped first, unless it is this one. Unstamped
    files are not preloaded: nothing could tell the run that they are still what was loaded."""
    from ..comfy_compat import loads_to_host
    key = load_key(model, precision)
    if _preloaded and _preloaded[0][0] == key:  # asked again (the prompt queued after the idle preload): it is here
        return
    drop_preloaded()
    if model.stamps:
        with loads_to_host():
            _preloaded.append((key, load_base_model(model, precision)))


def preload_is_for(model, precision: str | None) -> bool:
    """Whether the model loaded ahead of the run is this run's (then nothing more is loaded); one that is not is
    dropped now, so that what the run checks of the memory before its load is what it will have."""
    if _preloaded and _preloaded[0][0] == load_key(model, precision):
        return True
    drop_preloaded()
    return False


def drop_preloaded() -> None:
    import gc
    if _preloaded:
        _preloaded.clear()
        gc.collect()  # the weights leave before anything else is loaded in their place


def _take_preloaded(model, precision: str | None):
    """The preloaded patcher when it was loaded from exactly this model at this precision (its files unchanged
    since: the same stamps, checked again now); else None, and the preloaded one is dropped."""
    if not _preloaded:
        return None
    if not preload_is_for(model, precision):
        logging.getLogger(__name__).info("the model loaded ahead of this run is not its model: loading it afresh")
        return None
    patcher = _preloaded.pop()[1]
    check_stamps(model)
    logging.getLogger(__name__).info("%s: loaded ahead of the run, while the graph's earlier nodes ran", model.path)
    return patcher


def load_family(model, family: str = "auto", prediction: str = "auto", *, precision: str | None = None,
                deferred=None) -> ModelFamily:
    """The trainer's model: a run spec's ModelSpec (or, as before, a diffusion-model path with family and
    prediction) rebuilt with ComfyUI's code, ready to train (see ModelFamily.prepare_for_training).
    `precision` is train.precision: the dtype the base is held and computed in (fp8 bases: computed in).
    `deferred`: see load_base_model."""
    import torch
    model = _as_model_spec(model, family, prediction)
    check_family_name(model.family)  # before the load, which can take minutes
    if deferred is not None:
        drop_preloaded()  # a partitioned load reads each share from the file itself
    patcher = _take_preloaded(model, precision) if deferred is None else None
    if patcher is None:
        patcher = load_base_model(model, precision, deferred)
    result = family_for(patcher.model, model.family, model.prediction, patcher)
    if precision is not None:
        result.compute_dtype = getattr(torch, PRECISION_DTYPES[precision])
    result.prepare_for_training()
    return result


__all__ = ["Batch", "ModelFamily", "UnsupportedSetting", "FAMILIES", "SCRATCH_FAMILIES", "load_family",
           "preload_base_model", "preload_is_for", "drop_preloaded", "load_key",
           "load_base_model", "loader_options", "file_stamp", "check_stamps",
           "family_for", "family_class", "detect_prediction",
           "prediction_from_sampling"]
