"""Adapters (LoRA, LoHa, LoKr, DoRA) through peft, exported with ComfyUI keys, float32 alpha, kohya-style metadata."""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from .spec import ADAPTER_KINDS

ADAPTER_NAME = "default"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_magnitude_vector", "lora_embedding_A", "lora_embedding_B", "hada_w1_a",
                 "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "lokr_w1", "lokr_w1_a", "lokr_w1_b",
                 "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")  # peft's adapter tensors (the base is not one)


def is_adapter_tensor(name: str) -> bool:
    """Does this parameter name (in the diffusion model) belong to an injected adapter, not the base model?"""
    return any(f"{part}.{ADAPTER_NAME}" in name for part in ADAPTER_PARTS)


def base_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A layer's frozen weight as float32, whatever it is stored in: fp8 (ComfyUI's scaled-fp8 layers keep a
    per-tensor scale_weight), a quantized layout (ComfyUI 0.33) or a full-precision dtype."""
    from .comfy_compat import float_weight
    weight = float_weight(layer.weight)
    scale = getattr(layer, "scale_weight", None)
    return weight * scale.detach().float() if scale is not None else weight


def _peft_config(kind: str, targets: list[str], rank: int, alpha: float, dropout: float):
    import re

    from peft import LoHaConfig, LoKrConfig, LoraConfig
    # the layers by their whole names: peft matches a list of names by suffix too, so a target such as
    # "blocks.0.attn.qkv_proj" would adapt "token_refiner.blocks.0.attn.qkv_proj" as well (MiniMax H3's); a string is
    # matched whole (re.fullmatch)
    targets = "|".join(re.escape(name) for name in targets)
    if kind in ("lora", "dora"):
        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                          init_lora_weights=True, bias="none", use_dora=kind == "dora")
    if kind == "loha":
        return LoHaConfig(r=rank, alpha=alpha, rank_dropout=dropout, target_modules=targets)
    if kind == "lokr":
        return LoKrConfig(r=rank, alpha=alpha, rank_dropout=dropout, target_modules=targets)
    raise ValueError(f"adapter.kind: {kind!r} is not one of {ADAPTER_KINDS}")


def inject_adapter(diffusion_model: torch.nn.Module, targets: list[str], kind: str, rank: int, alpha: float,
                   dropout: float, zero_stage: int = 0):
    """Adds trainable adapter layers (peft) to `targets`; everything else is frozen. LoHa and LoKr make each layer's
    weight change again in the backward pass rather than keep it (recomputed_delta), except under ZeRO-3."""
    from peft import inject_adapter_in_model
    if not targets:
        raise ValueError("the adapter preset selects no layers of this model")
    fp8 = [name for name in targets if getattr(diffusion_model.get_submodule(name), "weight", None) is not None
           and diffusion_model.get_submodule(name).weight.dtype in FP8_DTYPES]
    if fp8 and kind == "dora":  # peft's DoRA adds the update to the stored weight, which fp8 cannot take part in
        raise ValueError(f"adapter.kind: DoRA needs the base weights in full precision, and {fp8[0]} is stored in "
                         "fp8; train a LoRA, LoHa or LoKr on an fp8 base, or load the model in its own precision")
    # a quantized base trains LoRA alone (family.check_quantized_weights refuses the rest before a run starts):
    # peft's LoHa, LoKr and DoRA layers take torch's own Linear only, and DoRA needs the stored weight
    from .comfy_compat import dequantize_per_matmul, is_linear, quantized_format
    diffusion_model.requires_grad_(False)
    custom = {}
    for name in targets:
        layer = diffusion_model.get_submodule(name)
        if quantized_format(layer):
            dequantize_per_matmul(layer)
        if is_linear(layer) and not isinstance(layer, torch.nn.Linear):  # ComfyUI's mixed-precision Linear
            from peft.tuners.lora.layer import Linear as LoraLinear
            custom[type(layer)] = LoraLinear
    for name in fp8:  # peft makes an adapter in its base layer's dtype: fp8 bases get full-precision adapters
        # what peft reads for a quantised base (bitsandbytes' attribute)
        diffusion_model.get_submodule(name).compute_dtype = torch.float32
    config = _peft_config(kind, targets, rank, alpha, dropout)
    if custom:
        config._register_custom_module(custom)  # peft's own LoRA layer around ComfyUI's Linear (its forward)
    inject_adapter_in_model(config, diffusion_model, adapter_name=ADAPTER_NAME)
    if kind in ("loha", "lokr") and zero_stage != 3:
        from .recomputed_delta import recompute_weight_changes
        recompute_weight_changes(diffusion_model)
    return [p for p in diffusion_model.parameters() if p.requires_grad]


def _f32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", torch.float32).contiguous()


def _by_module(peft_sd: dict) -> dict[str, dict[str, torch.Tensor]]:
    parts = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector", "hada_w1_a", "hada_w1_b", "hada_w2_a",
             "hada_w2_b", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in peft_sd.items():
        part = next((p for p in parts if key.endswith("." + p)), None)
        if part is None:
            raise ValueError(f"unexpected adapter tensor {key}")
        modules.setdefault(key[: -len(part) - 1], {})[part] = tensor
    return modules


# What a loader divides an output-axis dora_scale by, per output row: the norm of the base weight |W| (ComfyUI
# 0.3.64) or of the updated weight |W + dW| (the DoRA paper, peft, LyCORIS and so the kohya-based tools). With the
# latter the file's scale is the magnitude m itself; with the former it is m * |W| / |W + dW|: the same weight.
DORA_NORM_BASE, DORA_NORM_UPDATED = "base", "updated"
DORA_NORM_METADATA_KEY = "dora_norm"  # in the pack's metadata of DoRA files: which of the two the file is written for


@functools.lru_cache(maxsize=None)
def comfyui_dora_norm() -> str:
    """The norm the installed ComfyUI's own weight decomposition divides dora_scale by, found by asking it: its
    weight_decompose on a 2x2 weight whose update doubles it (W + dW = 2W) with dora_scale 1 returns
    2W / |W| (rows of norm 2) when it divides by |W|, and 2W / |2W| (rows of norm 1) when by |W + dW|.
    Cached: one call of a few microseconds per process."""
    from .comfy_env import import_comfy
    import_comfy()  # the trainer has it already; a process that writes or reads a file without a model may not
    from .comfy_compat import weight_decompose
    decompose, source = weight_decompose()  # read at call time: the one ComfyUI has now
    weight = torch.tensor([[3.0, 4.0], [0.0, 2.0]])  # row norms 5 and 2
    try:
        merged = decompose(torch.ones(2, 1), weight.clone(), weight.clone(), 1.0, 1.0, torch.float32, lambda d: d)
        row_norms = merged.float().norm(dim=1)
    except Exception as exc:  # noqa: BLE001 - any failure means the probe no longer fits ComfyUI
        raise RuntimeError(f"DoRA export: ComfyUI's weight_decompose ({source}) could not be "
                           f"probed ({type(exc).__name__}: {exc}); its signature changed, so the ComfyUI layout's "
                           "dora_scale convention is unknown (the kohya layout is not affected)") from None
    for norm, expected in ((DORA_NORM_BASE, 2.0), (DORA_NORM_UPDATED, 1.0)):
        if torch.allclose(row_norms, torch.full_like(row_norms, expected), rtol=1e-4):
            return norm
    raise RuntimeError(f"DoRA export: ComfyUI's weight_decompose ({source}) divides dora_scale "
                       f"by neither |W| nor |W + dW| (rows of a doubled weight came back with norms "
                       f"{row_norms.tolist()}, expected all 2 or all 1), so no ComfyUI-layout DoRA file can be written "
                       "that it reads as trained; export in the kohya layout instead")


def dora_norm_for(file_format: str) -> str:
    """The convention a DoRA file of this layout is written in: the kohya layout is for LyCORIS and the kohya-based
    tools (the paper's), the ComfyUI layout for the installed ComfyUI's own loader (asked, not assumed)."""
    return DORA_NORM_UPDATED if file_format == "kohya" else comfyui_dora_norm()


def dora_scale_from_magnitude(magnitude: torch.Tensor, weight: torch.Tensor, merged: torch.Tensor,
                              norm: str) -> torch.Tensor:
    """peft's DoRA computes (W + dW) * m / |W + dW| per output row; the scale a loader dividing by `norm` needs
    for the same weight. `magnitude` is [out, 1]; `weight` and `merged` (W + dW) are [out, in]."""
    if norm == DORA_NORM_UPDATED:
        return magnitude.contiguous()
    return (magnitude * weight.norm(dim=1, keepdim=True) / merged.norm(dim=1, keepdim=True)).contiguous()


def magnitude_from_dora_scale(dora_scale: torch.Tensor, weight: torch.Tensor, merged: torch.Tensor,
                              norm: str) -> torch.Tensor:
    """The inverse of dora_scale_from_magnitude."""
    if norm == DORA_NORM_UPDATED:
        return dora_scale
    return dora_scale * merged.norm(dim=1, keepdim=True) / weight.norm(dim=1, keepdim=True)


def comfy_adapter_state_dict(diffusion_model: torch.nn.Module, kind: str, alpha: float,
                             file_format: str = "comfyui") -> dict[str, torch.Tensor]:
    """peft's adapter tensors with the keys and conventions ComfyUI's LoRA loader reads
    (diffusion_model.<module>.lora_up/lora_down/alpha[/dora_scale], .hada_*, .lokr_*). `file_format` is the layout
    the tensors will be written in (export.convert renames them): it picks DoRA's dora_scale convention."""
    from peft import get_peft_model_state_dict
    dora_norm = dora_norm_for(file_format) if kind == "dora" else None
    out = {}
    for module, t in _by_module(get_peft_model_state_dict(diffusion_model, adapter_name=ADAPTER_NAME)).items():
        prefix = f"diffusion_model.{module}"
        layer = diffusion_model.get_submodule(module)
        scale = float(layer.scaling[ADAPTER_NAME])
        if kind in ("lora", "dora"):
            down, up = _f32(t["lora_A.weight"]), _f32(t["lora_B.weight"])
            out[f"{prefix}.lora_down.weight"], out[f"{prefix}.lora_up.weight"] = down, up
            out[f"{prefix}.alpha"] = torch.tensor(scale * down.shape[0], dtype=torch.float32)
            if kind == "dora":
                weight = base_weight(layer.get_base_layer()).cpu()
                merged = weight + scale * (up @ down)
                magnitude = _f32(t["lora_magnitude_vector"]).reshape(-1, 1)
                out[f"{prefix}.dora_scale"] = dora_scale_from_magnitude(magnitude, weight, merged, dora_norm)
        elif kind == "loha":
            for name in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"):
                out[f"{prefix}.{name}"] = _f32(t[name])
            out[f"{prefix}.alpha"] = torch.tensor(scale * t["hada_w1_b"].shape[0], dtype=torch.float32)
        elif kind == "lokr":
            # ComfyUI scales by alpha / (rank of the factored part) or by 1 when nothing is factored: peft's
            # scale goes into w1 and alpha is set to that rank, so ComfyUI's factor is exactly 1
            tensors = {name: _f32(value) for name, value in t.items()}
            w1 = "lokr_w1" if "lokr_w1" in tensors else "lokr_w1_a"
            tensors[w1] = tensors[w1] * scale
            dim = tensors["lokr_w2_b"].shape[0] if "lokr_w2_b" in tensors else \
                tensors["lokr_w1_b"].shape[0] if "lokr_w1_b" in tensors else 1
            for name, value in tensors.items():
                out[f"{prefix}.{name}"] = value.contiguous()
            out[f"{prefix}.alpha"] = torch.tensor(float(dim), dtype=torch.float32)
        else:
            raise ValueError(f"adapter.kind: {kind!r} is not one of {ADAPTER_KINDS}")
    return out


def _comfy_keyed(tensors: dict[str, torch.Tensor], diffusers_names: dict[str, str],
                 module_names=()) -> dict[str, torch.Tensor]:
    """Any of our file layouts (comfyui, kohya, diffusers) with ComfyUI keys. A kohya key names a layer by its
    diffusers name where the family has one (UNets), else by its ComfyUI name: `module_names`, the model's layers."""
    from .export import PREFIX, comfyui_readable, kohya_name
    tensors = comfyui_readable(tensors, diffusers_names)
    kohya_to_comfy = {kohya_name(comfy): comfy for comfy in module_names}
    kohya_to_comfy.update({kohya_name(name): comfy for comfy, name in diffusers_names.items()})
    kohya_to_comfy.update({kohya_name(comfy): comfy for comfy in diffusers_names})
    out = {}
    for key, tensor in tensors.items():
        if key.startswith("lora_unet_"):
            base, _, part = key.partition(".")
            if base not in kohya_to_comfy:
                raise ValueError(f"{key}: no layer of this model has that kohya name")
            key = f"{PREFIX}{kohya_to_comfy[base]}.{part}"
        out[key] = tensor
    return out


def _file_dora_norm(path: str, tensors: dict[str, torch.Tensor]) -> str:
    """The dora_scale convention a DoRA file was written in: as its metadata says (files this pack writes), else
    by its layout, as the export writes it."""
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
    try:
        pack = json.loads(meta.get(PACK_METADATA_KEY, "null"))
    except ValueError:
        pack = None
    norm = pack.get(DORA_NORM_METADATA_KEY) if isinstance(pack, dict) else None
    if norm in (DORA_NORM_BASE, DORA_NORM_UPDATED):
        return norm
    if isinstance(pack, dict):  # written by this pack before files said: every layout then suited ComfyUI 0.3.64
        return DORA_NORM_BASE
    return dora_norm_for("kohya" if any(k.startswith("lora_unet_") for k in tensors) else "comfyui")


def load_adapter_weights(diffusion_model: torch.nn.Module, kind: str, path: str,
                         diffusers_names: dict[str, str] | None = None):
    """Starts the injected adapter from a file this trainer wrote (any format): the inverse of
    comfy_adapter_state_dict, so the model computes what the file's model computed."""
    from safetensors.torch import load_file

    from .export import PREFIX, split_key
    try:
        raw = load_file(path)
        tensors = _comfy_keyed(raw, diffusers_names or {}, [name for name, _ in diffusion_model.named_modules()])
        dora_norm = _file_dora_norm(path, raw) if kind == "dora" else None
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter.init_from: {path}: {exc}") from None
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if not key.startswith(PREFIX):
            raise ValueError(f"adapter.init_from: {path}: unexpected key {key}")
        module, part = split_key(key)
        modules.setdefault(module, {})[part] = tensor.float()
    adapted = {name for name, m in diffusion_model.named_modules() if hasattr(m, "scaling") and ADAPTER_NAME in
               getattr(m, "scaling", {})}
    if set(modules) != adapted:
        raise ValueError(f"adapter.init_from: {path} holds {len(modules)} layers, the adapter targets {len(adapted)} "
                         f"(e.g. {sorted(set(modules) ^ adapted)[:2]}); choose the targets the file was trained with")

    def put(param, value: torch.Tensor, what: str):
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"adapter.init_from: {path}: {what} has shape {tuple(value.shape)}, the adapter "
                             f"{tuple(param.shape)} (a different rank or kind?)")
        with torch.no_grad():
            param.copy_(value.to(param.dtype))

    for module, t in modules.items():
        layer = diffusion_model.get_submodule(module)
        scale = float(layer.scaling[ADAPTER_NAME])
        if kind in ("lora", "dora"):
            down, up = t["lora_down.weight"], t["lora_up.weight"]
            file_scale = float(t["alpha"]) / down.shape[0] if "alpha" in t else 1.0
            put(layer.lora_A[ADAPTER_NAME].weight, down, f"{module} lora_down")
            put(layer.lora_B[ADAPTER_NAME].weight, up * (file_scale / scale), f"{module} lora_up")
            if kind == "dora":  # the inverse of the export's scale, in the convention the file was written in
                weight = base_weight(layer.get_base_layer()).cpu()
                merged = weight + file_scale * (up @ down)
                magnitude = magnitude_from_dora_scale(t["dora_scale"], weight, merged, dora_norm)
                put(layer.lora_magnitude_vector[ADAPTER_NAME].weight, magnitude.reshape(-1), f"{module} dora_scale")
        elif kind == "loha":
            file_scale = float(t["alpha"]) / t["hada_w1_b"].shape[0] if "alpha" in t else 1.0
            for name in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"):
                value = t[name] * (file_scale / scale) if name == "hada_w1_a" else t[name]
                put(getattr(layer, name)[ADAPTER_NAME], value, f"{module} {name}")
        elif kind == "lokr":
            dim = t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None
            file_scale = float(t["alpha"]) / dim if ("alpha" in t and dim) else 1.0
            w1 = "lokr_w1" if "lokr_w1" in t else "lokr_w1_a"
            for name, value in t.items():
                if name == "alpha":
                    continue
                value = value * (file_scale / scale) if name == w1 else value
                put(getattr(layer, name)[ADAPTER_NAME], value, f"{module} {name}")
        else:
            raise ValueError(f"adapter.init_from: continuing is for adapters, not {kind!r}")


def kohya_metadata(spec, family, num_images: int, steps_done: int, started_at: float,
                   gradient_checkpointing: bool | None = None) -> dict[str, str]:
    """kohya's ss_* metadata and the pack's own. `gradient_checkpointing`: what the run did, where the memory plan
    chose it ("auto"); else the spec's setting."""
    t, a = spec.train, spec.adapter
    meta = {
        "ss_network_module": "networks.lora" if a.kind in ("lora", "dora") else "lycoris.kohya",
        "ss_network_dim": str(a.rank),
        "ss_network_alpha": str(float(a.alpha)),
        "ss_network_dropout": str(a.dropout),
        "ss_base_model_version": family.base_model_version,
        "ss_v2": str(family.base_model_version == "sd_v2"),
        "ss_v_parameterization": str(family.prediction in ("v_prediction", "v_prediction_ddpm")),
        "ss_output_name": spec.output.name,
        "ss_training_started_at": str(started_at),
        "ss_training_finished_at": str(time.time()),
        "ss_steps": str(steps_done),
        "ss_max_train_steps": str(t.steps),
        "ss_learning_rate": str(t.learning_rate),
        "ss_unet_lr": str(t.learning_rate),
        "ss_text_encoder_lr": "0",
        "ss_lr_scheduler": t.lr_schedule,
        "ss_lr_warmup_steps": str(t.warmup_steps),
        "ss_optimizer": t.optimizer,
        "ss_batch_size_per_device": str(t.batch_size),
        "ss_gradient_accumulation_steps": str(t.grad_accum),
        "ss_gradient_checkpointing": str(t.gradient_checkpointing if gradient_checkpointing is None
                                         else gradient_checkpointing),
        "ss_mixed_precision": t.precision,
        "ss_seed": str(t.seed),
        "ss_num_train_images": str(num_images),
        "ss_resolution": "",
        # conv_dim / conv_alpha (strings, as kohya writes them): how kohya's and LyCORIS' LoCon say the
        # convolutions have an adapter too
        "ss_network_args": json.dumps({"targets": a.targets, "algo": a.kind,
                                       **({"dora_wd": True} if a.kind == "dora" else {}),
                                       **({"conv_dim": str(a.rank), "conv_alpha": str(float(a.alpha))}
                                          if a.targets == "all_layers" else {})}),
        PACK_METADATA_KEY: json.dumps({"spec_version": spec.version, "family": family.name,
                                       "prediction": family.prediction, "kind": a.kind,
                                       "format": spec.output.format,
                                       **({DORA_NORM_METADATA_KEY: dora_norm_for(spec.output.format)}
                                          if a.kind == "dora" else {})}),
    }
    return meta


PACK_METADATA_KEY = "ingraph_trainer"  # in every file this pack writes (adapters and full fine-tunes)


def written_by_pack(path: str | Path) -> bool:
    """Does this safetensors file carry the pack's metadata? Reads the header only (no tensors, no torch)."""
    from ..cache.files import safetensors_header
    meta = (safetensors_header(path) or {}).get("__metadata__")
    return isinstance(meta, dict) and PACK_METADATA_KEY in meta


def save_adapter_atomic(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Through the one atomic writer: readers (Load LoRA's list, other tools) never see a partial file."""
    from safetensors.torch import save_file

    from ..cache.files import atomic_write
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as staged:
        save_file(tensors, str(staged.path), metadata=metadata)
    return path
