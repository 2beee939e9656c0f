"""What differs between the ComfyUI versions the pack supports (0.3.64, October 2025, to 0.33, August 2026), in one
place: the next ComfyUI change that breaks the pack is fixed here.

- A wrapper of a ComfyUI function never has a narrower signature than the function: `wrap_method` installs one that
  takes whatever ComfyUI passes (0.33 added `assign` to `BaseModel.load_model_weights`, and the pack's narrower
  wrapper failed every model load).
- Model parameter dataclasses gain required fields (0.33: `FluxParams.txt_ids_dims`, `HunyuanVideoParams.
  use_cond_type_embedding`, `vision_in_dim`, `meanflow_sum`): `dit_config` fills each one the caller did not give
  with the value ComfyUI's own detection gives a file of the older layout, so a model built from a config is the
  one 0.3.64 built.
- Quantized weights (0.33's `QuantizedTensor` layouts, loaded by its mixed-precision ops, whose Linear is no
  `torch.nn.Linear`): which layers are linear, how many bytes a weight holds in its layout, its float value, and
  the setting that makes a layer dequantize its weight for each matmul instead of quantizing the input.
- ComfyUI's training switch (0.33's `model_management.in_training`, which its own TrainLoraNode sets): without it
  0.33's DiTs apply rotary embeddings with comfy-kitchen kernels that have no backward (`enter_training`).
- Model code whose structure changed: HunyuanVideo's joint sequence order (`joint_sequence_text_first`) and how
  LTX-Video prepares its inputs and positions (`ltx_rope_split_mode`), read from the model itself, for the pipeline
  layers that rebuild its forward.
- A layer's weight as its forward casts it (`cast_weight`), for a backward pass that casts it again.
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


def dequantize_per_matmul(module) -> None:
    """A quantized layer computes with its weight dequantized to the input's dtype for each matmul (ComfyUI's cast
    path), never with its input quantized: the gradient that reaches the adapter is the full-precision one."""
    module.comfy_force_cast_weights = True


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
