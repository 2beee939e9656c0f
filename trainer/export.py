"""Adapter file formats. Training always produces ComfyUI keys (diffusion_model.<module>.<part>);
the other formats are renamings of those tensors:

- "comfyui": diffusion_model.<module>.lora_up.weight / lora_down.weight / alpha (and hada_*, lokr_*, dora_scale
  in the installed ComfyUI's own convention, asked at export: adapters.comfyui_dora_norm)
- "kohya": lora_unet_<diffusers module with _>.<part> (kohya sd-scripts and LyCORIS; ComfyUI reads it too);
  dora_scale is the paper's magnitude m, as LyCORIS and peft divide by the updated weight's norm
- "diffusers": unet.<diffusers module>.lora_A.weight / lora_B.weight, the peft layout diffusers loads;
  it has no alpha, so alpha / rank is folded into lora_B (LoRA only)
"""
from __future__ import annotations

import torch

from .spec import ADAPTER_FORMATS  # each choice is defined once, with its label, in spec/choices.py
DIFFUSERS_KINDS = ("lora",)
PREFIX = "diffusion_model."


def kohya_name(module: str) -> str:
    """kohya's key for a module (diffusers name where the family has one): dots become underscores."""
    return "lora_unet_" + module.replace(".", "_")


def split_key(key: str) -> tuple[str, str]:
    """'diffusion_model.<module>.<part>' → (module, part); parts end in .weight or are one word."""
    body = key[len(PREFIX):]
    cut = 2 if body.endswith(".weight") else 1
    pieces = body.split(".")
    return ".".join(pieces[:-cut]), ".".join(pieces[-cut:])


def convert(tensors: dict[str, torch.Tensor], fmt: str, diffusers_names: dict[str, str]) -> dict[str, torch.Tensor]:
    """`diffusers_names`: ComfyUI module name → diffusers module name (empty where the family has none)."""
    if fmt == "comfyui":
        return tensors
    if fmt not in ADAPTER_FORMATS:
        raise ValueError(f"output.format: {fmt!r} is not one of {ADAPTER_FORMATS}")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, part = split_key(key)
        modules.setdefault(module, {})[part] = tensor
    out = {}
    for module, parts in modules.items():
        name = diffusers_names.get(module)
        if fmt == "kohya":
            base = kohya_name(name or module)
            out.update({f"{base}.{part}": t for part, t in parts.items()})
            continue
        if name is None:
            raise ValueError(f"output.format: this model has no diffusers name for {module}; use comfyui or kohya")
        if set(parts) != {"lora_down.weight", "lora_up.weight", "alpha"}:
            raise ValueError("output.format: the diffusers format holds plain LoRA only")
        down, up = parts["lora_down.weight"], parts["lora_up.weight"]
        scale = float(parts["alpha"]) / down.shape[0]
        out[f"unet.{name}.lora_A.weight"] = down
        out[f"unet.{name}.lora_B.weight"] = (up * scale).contiguous()
    return out


def diffusers_module_names(base_model) -> dict[str, str]:
    """ComfyUI (ldm) module name → diffusers module name, from ComfyUI's own key map (UNets only: other
    families have none, and their kohya keys are their ComfyUI module names)."""
    from .comfy_compat import unet_to_diffusers
    if "num_res_blocks" not in base_model.model_config.unet_config:
        return {}
    mapping = unet_to_diffusers(base_model.model_config.unet_config)
    return {ldm[: -len(".weight")]: diffusers[: -len(".weight")]
            for diffusers, ldm in mapping.items() if diffusers.endswith(".weight") and ldm.endswith(".weight")}


def comfyui_readable(tensors: dict[str, torch.Tensor], diffusers_names: dict[str, str]) -> dict[str, torch.Tensor]:
    """A file of any of our formats as tensors ComfyUI's LoRA loader reads (it reads comfyui and kohya keys
    itself; peft-layout diffusers keys of attention layers it does not, so those are renamed back)."""
    if not any(k.startswith("unet.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors):
        return tensors
    to_comfy = {d: c for c, d in diffusers_names.items()}
    out = {}
    for key, tensor in tensors.items():
        name, _, part = key[len("unet."):].rpartition(".lora_")
        if name not in to_comfy:
            raise ValueError(f"{key}: no ComfyUI module for diffusers module {name}")
        prefix = f"{PREFIX}{to_comfy[name]}"
        if part == "A.weight":
            out[f"{prefix}.lora_down.weight"] = tensor
            out[f"{prefix}.alpha"] = torch.tensor(float(tensor.shape[0]))  # alpha / rank was folded into B
        else:
            out[f"{prefix}.lora_up.weight"] = tensor
    return out
