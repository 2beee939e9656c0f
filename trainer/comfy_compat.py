"""What differs between the ComfyUI versions the pack supports (0.3.64, October 2025, to 0.33, August 2026), in one
place: the next ComfyUI change that breaks the pack is fixed here.

- A wrapper of a ComfyUI function never has a narrower signature than the function (`wrap_method`: 0.33 added
  `assign` to `BaseModel.load_model_weights`, and the pack's narrower wrapper failed every model load).
- Model parameter dataclasses gain required fields (0.33: `FluxParams.txt_ids_dims`, HunyuanVideo's three):
  `dit_config` fills each with the value ComfyUI's detection gives a file of the older layout.
- Quantized weights (0.33's `QuantizedTensor` layouts, whose Linear is no `torch.nn.Linear`): which layers are
  linear, a weight's bytes and float value, and dequantizing the weight for each matmul.
- ComfyUI's training switch (0.33's `model_management.in_training`): without it 0.33's DiTs apply rotary embeddings
  with comfy-kitchen kernels that have no backward (`enter_training`).
- Model code whose structure changed (HunyuanVideo's joint sequence order, LTX-Video's positions), read from the
  model itself for the pipeline layers that rebuild its forward; a layer's weight as its forward casts it.
- ComfyUI's loaders as the pack calls them (model, VAE and LoRA files).
- Which version is installed (`comfyui_version`), for the rare decision that needs it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from pathlib import Path

# required fields ComfyUI added after 0.3.64, per parameter class → the value its detection gives a file without the
# newer feature (comfy/model_detection.py of 0.33: plain Flux and Chroma take no text-position ids; HunyuanVideo 1.0
# has no condition-type embedding and no vision input; Chroma has no pooled-vector input)
LEGACY_DIT_FIELDS = {
    "FluxParams": {"txt_ids_dims": []},
    "ChromaParams": {"txt_ids_dims": [], "vec_in_dim": None},
    "HunyuanVideoParams": {"use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False},
}

_WRAP_LOCK = threading.RLock()


def comfyui_version(comfyui_dir: str | Path) -> tuple[int, ...]:
    """The version of the ComfyUI at `comfyui_dir` (its comfyui_version.py), as numbers; () where it says none."""
    import re
    try:
        text = (Path(comfyui_dir) / "comfyui_version.py").read_text()
    except OSError:
        return ()
    found = re.search(r"""__version__\s*=\s*["']([0-9.]+)""", text)
    return tuple(int(part) for part in found.group(1).strip(".").split(".")) if found else ()


def dit_config(params_cls, config: dict) -> dict:
    """`config` (keyword arguments of a ComfyUI diffusion model whose parameters are the dataclass `params_cls`) plus
    each required field of the installed ComfyUI's dataclass that it lacks and that LEGACY_DIT_FIELDS knows."""
    extra, legacy = {}, LEGACY_DIT_FIELDS.get(params_cls.__name__, {})
    for field in dataclasses.fields(params_cls):
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if required and field.name not in config and field.name in legacy:
            value = legacy[field.name]
            extra[field.name] = list(value) if isinstance(value, list) else value
    return {**config, **extra}


def build_dit(model_cls, params_cls, **config):
    """`model_cls(**config)` with `dit_config`'s fields added (the model's `operations`, `dtype`... pass through)."""
    return model_cls(**dit_config(params_cls, config))


@contextlib.contextmanager
def wrap_method(owner, name: str, make_wrapper):
    """For the block's duration, `owner.name` is `make_wrapper(original)`; the original is put back after. The
    wrapper must take `(self, *args, **kwargs)`, whatever ComfyUI passes (refused here otherwise: a narrower one
    broke every load when 0.33 added an argument). One wrapping of a method at a time (a lock), since it replaces a
    class attribute every thread sees."""
    import inspect
    with _WRAP_LOCK:
        original = owner.__dict__[name]
        wrapper = make_wrapper(original)
        kinds = {p.kind for p in inspect.signature(wrapper).parameters.values()}
        if not {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
            raise TypeError(f"the wrapper of {owner.__name__}.{name} must take *args and **kwargs, "
                            f"not {inspect.signature(wrapper)}")
        setattr(owner, name, functools.wraps(original)(wrapper))
        try:
            yield original
        finally:
            setattr(owner, name, original)


@contextlib.contextmanager
def loads_to_host():
    """Within: ComfyUI builds loaded models in host memory, whatever device `unet_inital_load_device` would pick (the
    GPU where it has more free memory): a standby's preload takes no GPU memory the graph's earlier nodes use."""
    import comfy.model_management
    import torch
    with wrap_method(comfy.model_management, "unet_inital_load_device",
                     lambda original: lambda *args, **kwargs: torch.device("cpu")):
        yield


def is_quantized(tensor) -> bool:
    """A ComfyUI QuantizedTensor (comfy_kitchen's): its dtype is the dtype it stands for, its storage another."""
    return type(tensor).__name__ == "QuantizedTensor" and hasattr(tensor, "dequantize")


def quantized_format(module) -> str | None:
    """The QUANT_ALGOS name a ComfyUI mixed-precision layer's weight is stored in, None where it is not quantized."""
    weight = getattr(module, "weight", None)
    return getattr(module, "quant_format", None) if weight is not None and is_quantized(weight) else None


def is_linear(module) -> bool:
    """A linear layer, as torch's or as ComfyUI's mixed-precision ops make it (a quantized file's layers, and the
    layers it left in full precision, are `Linear` modules that are no torch.nn.Linear)."""
    import torch
    if isinstance(module, torch.nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Linear" and hasattr(module, "in_features") and hasattr(module, "out_features")
            and weight is not None and len(weight.shape) == 2)


def tensor_bytes(tensor) -> int:
    """Bytes a tensor holds: a quantized one's data and scales in their own dtypes."""
    if is_quantized(tensor):
        return sum(t.numel() * t.element_size() for t in tensor.state_dict("w").values())
    return tensor.numel() * tensor.element_size()


def float_weight(tensor):
    """A weight's value as float32, dequantized where it is quantized."""
    data = tensor.detach()
    return data.dequantize().float() if is_quantized(data) else data.float()


class _Dequantized:
    """An identity weight function. With one in a layer's `weight_function`, ComfyUI's cast always dequantizes the
    weight: without it, a weight whose dtype already is the compute dtype (a file quantized from fp32, trained in
    fp32) reaches F.linear quantized, and layouts whose matmul takes only a transposed weight (ConvRot w4a4) fail
    in backward."""

    def __call__(self, weight):
        return weight


def dequantize_per_matmul(module) -> None:
    """A quantized layer computes with its weight dequantized to the input's dtype for each matmul (ComfyUI's cast
    path), never with its input quantized: the gradient that reaches the adapter is the full-precision one."""
    module.comfy_force_cast_weights = True
    if not any(isinstance(f, _Dequantized) for f in module.weight_function):
        # a new list of the layer's own: until ComfyUI's load gives a layer one, `weight_function` is the op class's
        # list, shared by every layer of every model in the process (an append there made them all cast per call)
        module.weight_function = [*module.weight_function, _Dequantized()]
    module.ingraph_dequantized = True  # ComfyUI's loads reset the two above; this mark survives them


def dequantize_per_matmul_again(model) -> None:
    """After ComfyUI loaded the training model (a preview samples through its patcher): ModelPatcher.load resets
    every layer's comfy_force_cast_weights and weight_function, so the trained quantized layers get them back."""
    for module in model.modules() if hasattr(model, "modules") else ():
        if getattr(module, "ingraph_dequantized", False):
            dequantize_per_matmul(module)


def quantized_layouts(model) -> dict[str, str]:
    """{layout: the first layer stored in it} over a model's modules (empty for a model with no quantized layer)."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        layout = quantized_format(module)
        if layout and layout not in found:
            found[layout] = name
    return found


def cast_weight(layer, dtype, device):
    """A ComfyUI layer's weight as its forward computes with it: moved, cast to `dtype` (a scaled or quantized
    weight dequantized) and passed through its weight functions. Both versions' `cast_bias_weight` return (weight,
    bias) when not asked for an offload stream."""
    import comfy.ops
    return comfy.ops.cast_bias_weight(layer, dtype=dtype, device=device, bias_dtype=dtype)[0]


def joint_sequence_text_first(hunyuan_model) -> bool:
    """Whether HunyuanVideo's joint sequence (and its positions) puts the text tokens before the image's: 0.3.64
    built its double blocks flipped (image first), 0.33 joins text first."""
    blocks = hunyuan_model.double_blocks
    return not getattr(blocks[0], "flipped_img_txt", False) if len(blocks) else True


def ltx_rope_split_mode(ltx_model):
    """How an LTX model's blocks take their positions. 0.33's LTX models prepare their inputs in steps
    (`_process_input` and the `_prepare_*` methods) and hand the blocks (rotation matrix, split mode): this gives
    the split mode, constant per model. None for 0.3.64's, whose blocks take (cos, sin)."""
    if not hasattr(ltx_model, "_prepare_positional_embeddings"):
        return None
    from comfy.ldm.lightricks.model import LTXRopeType
    return ltx_model.split_positional_embedding == LTXRopeType.SPLIT


def layout_problem(layout: str, device) -> str | None:
    """Why weights in `layout` cannot train on `device` (None where they can): the layout's own quantize,
    dequantize and linear run on a small matrix there, as a training step runs them, with autograd on even where
    the caller has it off (ComfyUI runs every node under inference_mode)."""
    import torch
    try:
        with torch.inference_mode(False), torch.enable_grad():
            return _layout_probe(layout, device)
    except Exception as exc:  # noqa: BLE001  whatever the layout's kernels raise on this device
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _layout_probe(layout: str, device) -> str | None:
    import torch
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor
    if layout not in QUANT_ALGOS:
        return f"this ComfyUI defines no layout {layout!r}"
    weight = QuantizedTensor.from_float(torch.randn(64, 256, device=device), QUANT_ALGOS[layout]["comfy_tensor_layout"])
    x = torch.randn(4, 256, device=device, requires_grad=True)
    torch.nn.functional.linear(x, weight.dequantize().to(x.dtype)).sum().backward()
    return None


def enter_training() -> None:
    """Tells ComfyUI its models are being trained in this process (0.33 and later; nothing on older versions): its
    ops then take the paths autograd can go back through (rotary embeddings without comfy-kitchen's forward-only
    kernels, no fused INT8 activations). The trainer process trains, evaluates and previews, so it is set once."""
    import comfy.model_management
    if hasattr(comfy.model_management, "in_training"):
        comfy.model_management.in_training = True


# --- every other call the pack makes into comfy.* (model files aside: trainer/models/ builds ComfyUI's own model
# classes, one file per family) ---------------------------------------------------------------------------------

def progress_bar(total: int, node_id: str | None = None):
    """ComfyUI's progress bar of the node running (or of `node_id`): `.update(n)`, `.update_absolute(value, total)`."""
    import comfy.utils
    return comfy.utils.ProgressBar(total, node_id=node_id)


def raise_if_interrupted() -> None:
    """Raises ComfyUI's interrupt exception once the user pressed Cancel (or a client POSTed /interrupt)."""
    import comfy.model_management
    comfy.model_management.throw_exception_if_processing_interrupted()


def sampler_and_scheduler_names() -> tuple[list[str], list[str]]:
    """KSampler's sampler and scheduler choices in this ComfyUI."""
    import comfy.samplers
    return list(comfy.samplers.KSampler.SAMPLERS), list(comfy.samplers.KSampler.SCHEDULERS)


def scheduler_sigmas(model_sampling, scheduler: str, steps: int):
    """The sigmas KSampler visits for `steps` steps of `scheduler` (the last one, 0, included)."""
    import comfy.samplers
    return comfy.samplers.calculate_sigmas(model_sampling, scheduler, steps)


# the pixels per latent cell that ComfyUI 0.33's latent formats state (spacial_downscale_ratio), for the formats
# ComfyUI 0.3.64 already had without stating it (its empty-latent nodes divide by these); any other: its VAEs' 8
_CELL_PIXELS_BEFORE_033 = {"Wan22": 16, "LTXV": 32, "HunyuanImage21": 32, "ChromaRadiance": 1}


def latent_cell_pixels(latent_format) -> int:
    """How many pixels one latent cell spans on a side, as ComfyUI's empty-latent nodes size a latent."""
    return (getattr(latent_format, "spacial_downscale_ratio", None)
            or _CELL_PIXELS_BEFORE_033.get(type(latent_format).__name__, 8))


def sample(patcher, latent, seed: int, steps: int, cfg: float, sampler: str, scheduler: str, positive, negative):
    """What KSampler returns for an empty `latent` (its channels fixed to the model's, as KSampler does)."""
    import comfy.sample
    latent = comfy.sample.fix_empty_latent_channels(patcher, latent)
    noise = comfy.sample.prepare_noise(latent, seed)
    out = comfy.sample.sample(patcher, noise, steps, cfg, sampler, scheduler, positive, negative, latent, seed=seed,
                              disable_pbar=True)
    # a joint audio-video model's (MiniMax H3's empty latent becomes a nested video and audio pair): its video stream
    return out.unbind()[0] if getattr(out, "is_nested", False) else out


def torch_device():
    """The device ComfyUI computes on."""
    import comfy.model_management
    return comfy.model_management.get_torch_device()


@contextlib.contextmanager
def free_memory_answers_for(asked, answer):
    """Within: ComfyUI's free-memory query about device `asked` answers for device `answer` (the memory plan's
    meta pass: ComfyUI chooses how to split attention by the free memory it is told)."""
    import comfy.model_management as mm

    def make(real):
        return lambda dev=None, *args, **kwargs: real(
            answer if dev is not None and getattr(dev, "type", dev) == asked.type else dev, *args, **kwargs)
    with wrap_method(mm, "get_free_memory", make):
        yield


def load_tensors(path: str) -> dict:  # a .safetensors (or pickle-free .pt) file's tensors, as ComfyUI reads them
    import comfy.utils
    return comfy.utils.load_torch_file(str(path), safe_load=True)


def with_lora(patcher, tensors: dict, strength: float = 1.0):
    """A clone of the MODEL with a LoRA's tensors applied, as LoraLoaderModelOnly applies them (lazily)."""
    import comfy.sd
    return comfy.sd.load_lora_for_models(patcher, None, tensors, strength, 0.0)[0]


def load_model_file(path: str, from_checkpoint: bool, options: dict):
    """The MODEL (a ModelPatcher; None where ComfyUI recognises none) of a checkpoint, as Load Checkpoint loads it
    (no encoders, no VAE built), or of a diffusion-model file, as Load Diffusion Model does with `options`."""
    import comfy.sd
    if from_checkpoint:
        return comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False,
                                                     output_clipvision=False, model_options=options)[0]
    return comfy.sd.load_diffusion_model(str(path), model_options=options)


def load_vae_file(path: str, from_checkpoint: bool):
    """The VAE of a VAE file (VAELoader) or inside a checkpoint (Load Checkpoint; nothing else of it built)."""
    import comfy.sd
    if from_checkpoint:
        return comfy.sd.load_checkpoint_guess_config(str(path), output_vae=True, output_clip=False,
                                                     output_clipvision=False, output_model=False)[2]
    import comfy.utils
    sd, metadata = comfy.utils.load_torch_file(str(path), safe_load=True, return_metadata=True)
    # with the file's metadata where this ComfyUI's VAELoader passes it on (0.33 does, 0.3.64 does not, and its VAE
    # would build an LTX-Video VAE from a configuration the graph's VAE never read): some VAEs carry their
    # configuration there, and a materialised TAE its latent width (runner/materialise.py: 0.33's taef2)
    if not vae_loader_reads_metadata():
        metadata = None
    elif metadata and "tae_latent_channels" in metadata:
        metadata = {**metadata, "tae_latent_channels": int(metadata["tae_latent_channels"])}
    return comfy.sd.VAE(sd=sd, metadata=metadata)


@functools.cache
def vae_loader_reads_metadata() -> bool:
    """Whether the running ComfyUI's VAELoader hands a VAE file's metadata to comfy.sd.VAE (read from its nodes.py
    source, which the trainer does not import: its import loads every node's module)."""
    import re
    import comfy.sd
    try:  # the ComfyUI the trainer imported (comfy_env checks it is COMFYUI_PATH's)
        text = (Path(comfy.sd.__file__).resolve().parent.parent / "nodes.py").read_text(encoding="utf-8")
    except OSError:
        return False
    loader = re.search(r"^class VAELoader\b.*?(?=^class )", text, re.S | re.M)
    return bool(loader) and "return_metadata=True" in loader.group(0)


def weight_decompose():
    """(ComfyUI's DoRA weight decomposition as its LoRA loader calls it now, the file that defines it)."""
    import comfy.weight_adapter.base as base
    return base.weight_decompose, base.__file__


def model_from_state_dict(state: dict):
    """The MODEL ComfyUI's loader detects for a diffusion model's tensors (None where it recognises none)."""
    import comfy.sd
    return comfy.sd.load_diffusion_model_state_dict(state)


def unet_to_diffusers(unet_config: dict) -> dict:  # ComfyUI's key map of a UNet: diffusers key → ldm key
    import comfy.utils
    return comfy.utils.unet_to_diffusers(unet_config)


def loaded_models() -> list:  # the models ComfyUI holds loaded (its LoadedModel records)
    import comfy.model_management as mm
    return list(mm.current_loaded_models)


def unload_all_models() -> None:
    """Every model ComfyUI loaded goes back to its offload device, and its cache is emptied."""
    import comfy.model_management as mm
    mm.unload_all_models()
    mm.soft_empty_cache(True)


def forget_loaded(patcher, unload: bool) -> None:
    """Takes `patcher` off ComfyUI's list of loaded models, first unloading it (to its offload device) if asked."""
    import comfy.model_management as mm
    for loaded in [m for m in mm.current_loaded_models if m.model is patcher]:
        if unload:
            loaded.model_unload()
        mm.current_loaded_models.remove(loaded)


def patched_weight(patcher, key: str, patches: list):
    """The weight at `key` ("diffusion_model.<name>") with `patches` applied, computed on the CPU the way
    ModelPatcher.patch_weight_to_device does, without loading the model or changing it."""
    import torch
    import comfy.float
    import comfy.lora
    from comfy.model_patcher import get_key_weight, string_to_seed
    weight, set_func, convert_func = get_key_weight(patcher.model, key)
    temp = weight.detach().to("cpu", torch.float32, copy=True)
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    out = comfy.lora.calculate_weight(patches, temp, key)
    # a weight stored through set_func (scaled fp8) keeps its exact value; others round as ComfyUI does
    return out if set_func is not None else comfy.float.stochastic_rounding(out, weight.dtype, seed=string_to_seed(key))
