"""LoRA through peft, exported with ComfyUI keys, float32 alpha and kohya-style metadata."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

ADAPTER_NAME = "default"


def inject_lora(diffusion_model: torch.nn.Module, targets: list[str], rank: int, alpha: float, dropout: float):
    """Adds trainable LoRA layers to `targets`; everything else is frozen."""
    from peft import LoraConfig, inject_adapter_in_model
    if not targets:
        raise ValueError("the adapter preset selects no layers of this model")
    diffusion_model.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        init_lora_weights=True, bias="none")
    inject_adapter_in_model(config, diffusion_model, adapter_name=ADAPTER_NAME)
    return [p for p in diffusion_model.parameters() if p.requires_grad]


def comfy_lora_state_dict(diffusion_model: torch.nn.Module, alpha: float) -> dict[str, torch.Tensor]:
    """peft's lora_A / lora_B become ComfyUI's diffusion_model.<module>.lora_down / lora_up / alpha."""
    from peft import get_peft_model_state_dict
    peft_sd = get_peft_model_state_dict(diffusion_model, adapter_name=ADAPTER_NAME)
    out = {}
    for key, tensor in peft_sd.items():
        for peft_part, comfy_part in ((".lora_A.weight", "lora_down"), (".lora_B.weight", "lora_up")):
            if key.endswith(peft_part):
                module = key[: -len(peft_part)]
                out[f"diffusion_model.{module}.{comfy_part}.weight"] = tensor.detach().to("cpu", torch.float32).contiguous()
                out[f"diffusion_model.{module}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
                break
        else:
            raise ValueError(f"unexpected adapter tensor {key}")
    return out


def kohya_metadata(spec, family, num_images: int, steps_done: int, started_at: float) -> dict[str, str]:
    t, a = spec.train, spec.adapter
    meta = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(a.rank),
        "ss_network_alpha": str(float(a.alpha)),
        "ss_network_dropout": str(a.dropout),
        "ss_base_model_version": family.base_model_version,
        "ss_v2": str(family.base_model_version == "sd_v2"),
        "ss_v_parameterization": str(family.prediction == "v_prediction"),
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
        "ss_gradient_checkpointing": str(t.gradient_checkpointing),
        "ss_mixed_precision": t.precision,
        "ss_seed": str(t.seed),
        "ss_num_train_images": str(num_images),
        "ss_resolution": "",
        "ss_network_args": json.dumps({"targets": a.targets}),
        "ingraph_trainer": json.dumps({"spec_version": spec.version, "family": family.name,
                                       "prediction": family.prediction}),
    }
    return meta


def save_adapter_atomic(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write to a temporary file beside the target, then rename: readers never see a partial file."""
    from safetensors.torch import save_file
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".partial")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from a ComfyUI run by another user
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
