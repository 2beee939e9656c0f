"""The device a trainer process computes on, decided once, before ComfyUI or any model is imported.

Each rank takes the GPU of its local rank (LOCAL_RANK, set by the launcher; 0 for one process) as CUDA's current
device. ComfyUI then picks it up wherever it asks for "the" device (`model_management.get_torch_device()` is the
current CUDA device unless `--cuda-device` was given): the model's load and offload devices, previews' sampling,
evaluation, and the CUDA context its import opens, which would otherwise all be GPU 0 on every rank. fp32 matmuls
and convolutions use TF32 on cards that have it (Ampere and newer), as ComfyUI and every peer trainer do.
"""
from __future__ import annotations

import os

TF32_FROM_MAJOR = 8  # compute capability 8.x (Ampere) and newer have TF32 tensor cores


def local_cuda_index() -> int | None:
    """This process's GPU (its local rank), or None where CUDA is absent."""
    import torch
    if not torch.cuda.is_available():
        return None
    return int(os.environ.get("LOCAL_RANK") or 0)


def choose_device():
    """Makes this process's GPU the current CUDA device (with TF32 where the card has it) and returns it; the CPU
    where there is no GPU."""
    import torch
    index = local_cuda_index()
    if index is None:
        return torch.device("cpu")
    torch.cuda.set_device(index)
    if torch.cuda.get_device_capability(index)[0] >= TF32_FROM_MAJOR:
        torch.set_float32_matmul_precision("high")  # TF32 matmuls (torch's stable switch across versions)
        torch.backends.cudnn.allow_tf32 = True
    return torch.device("cuda", index)


def concrete_precision(choice: str) -> str:
    """train.precision "auto" on this process's device: bf16 where it computes in it (a GPU from Ampere on, or the
    CPU), else fp16 (with loss scaling); any other choice as it is."""
    if choice != "auto":
        return choice
    import torch
    if local_cuda_index() is not None and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "fp16"
    return "bf16"


def training_device():
    """The device a run trains on: in a trainer rank (LOCAL_RANK set by the launcher), its own GPU; in the ComfyUI
    process checking a node's settings, ComfyUI's device (on the machine the trainer will use)."""
    index = local_cuda_index()
    if os.environ.get("LOCAL_RANK") and index is not None:
        import torch
        return torch.device("cuda", index)
    from .comfy_compat import torch_device
    return torch_device()


def device_memory(device) -> dict | None:
    """The run's device memory so far (bytes): the allocator's peak, what it reserved at most, and the card's
    total; None on the CPU. The memory plan's measurement on a GPU."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch
    return {"peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device),
            "total": torch.cuda.get_device_properties(device).total_memory}
