"""ZeRO-3's load with no whole copy of the model on any process.

Without it, every process builds and fills the whole model in host memory, and DeepSpeed partitions it afterwards
(on a GPU, after moving it whole to the device). Here ComfyUI builds the model with its parameters left unfilled
(models/loading.py: torch.empty, whose pages are not touched), DeepSpeed partitions them one by one (zero.Init on
the built module: each process keeps its slice, on its device), and each process then copies its own slice of
every weight straight from the memory-mapped file, dropping the file's pages once copied. A process's host memory
during the load peaks at about its share of the weights, not the whole model (or twice it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


COPY_CHUNK = 1 << 20  # elements


@dataclass
class DeferredWeights:
    """The file's tensor (memory-mapped) for each parameter of the model left unfilled at its load.
    `before_whole_load(why)` runs where the model turns out to need a whole load after all (loading.why_not_deferred),
    before anything is filled: the host check made for a share is made again for the whole copy."""
    path: str
    sources: dict = field(default_factory=dict)
    before_whole_load: Callable[[str], None] | None = None


def why_not_partitioned(spec) -> str | None:
    """None where the run loads its model straight into ZeRO-3 partitions; else why it loads it whole first."""
    d, a = spec.distributed, spec.adapter
    if d.zero_stage != 3 or d.pipeline_stages > 1:
        return "not ZeRO-3"
    from .distributed import processes_per_machine, world_size
    if 1 < processes_per_machine() < world_size():  # hpZ's second partition is built from the unfilled weights
        return "ZeRO++'s second partition within each machine is not filled by this load"
    if a.kind in ("full", "dora"):  # the optimizer's copies, DoRA's weight norms: taken from the weights at start
        return f"adapter.kind {a.kind} reads the base weights before the engine starts"
    if spec.model.lora_paths:
        return "LoRAs upstream of the Train node are baked into the base weights first"
    return None


def load_partitions(deepspeed, module, weights: DeferredWeights, config: dict, dtype=None) -> int:
    """Partitions `module`'s parameters as ZeRO-3 does (deepspeed.zero.Init on the built module, before
    deepspeed.initialize, which then finds them partitioned and moves nothing whole), then fills this process's
    slice of each deferred parameter from the file. `dtype`: the engine's (bf16, fp16; None in fp32), which the
    parameters take first (in_engine_dtype). Returns the bytes copied."""
    import torch
    import deepspeed.comm as dist
    from ..models.loading import file_releaser
    from ..device import training_device
    device = training_device()
    for sub in module.modules():  # deepspeed.initialize moves nothing of a model zero.Init partitioned: buffers too
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != device:
                sub._buffers[name] = buffer.to(device)
    in_engine_dtype(module, dtype, weights)
    deepspeed.zero.Init(module=module, config_dict_or_path=config)
    releaser = file_releaser(weights.path)
    copied = 0
    try:
        with torch.no_grad():
            for param, source in weights.sources.items():
                # DeepSpeed's own layout (partition_parameters._partition_param): the flattened tensor, padded to
                # a multiple of the processes, in equal consecutive slices by rank in the parameter's group
                part = param.ds_tensor
                start = part.ds_numel * dist.get_rank(group=param.ds_process_group)
                count = min(part.ds_numel, param.ds_numel - start)
                flat = source.reshape(-1)
                for offset in range(0, max(count, 0), COPY_CHUNK):  # the file's pages held: one chunk's at a time
                    n = min(COPY_CHUNK, count - offset)
                    piece = flat.narrow(0, start + offset, n)
                    part.narrow(0, offset, n).copy_(piece)
                    copied += n * part.element_size()
                    if releaser is not None:
                        releaser.release(piece)
    finally:
        if releaser is not None:
            releaser.close()
    weights.sources.clear()  # the file's tensors: nothing keeps the mapping once the load is done
    return copied


def in_engine_dtype(module, dtype, weights: DeferredWeights) -> None:
    """DeepSpeed's own cast to bf16/fp16 (engine._cast_module_mixed_precision), which deepspeed.initialize leaves out
    for a model zero.Init partitioned: every floating-point parameter in the engine's dtype (fp8 and quantized ones
    stay). An unfilled parameter gets unfilled storage of that dtype: the fill casts each slice as it copies it."""
    import torch
    from .plain_engine import LOW_PRECISION_CASTABLE
    if dtype is None:
        return
    for param in module.parameters():
        if param.dtype in LOW_PRECISION_CASTABLE and param.dtype != dtype:
            param.data = torch.empty(param.shape, dtype=dtype, device=param.device) if param in weights.sources \
                else param.data.to(dtype)


def each_process_peak(load_memory: dict) -> dict:
    """The load's peak now that the partitions are filled (memory.load_peak's restarted high-water mark, which the
    partitioning and the fill are part of), and every process's rise above its own start ("rank_rises", by rank;
    the events are rank 0's alone). Collective."""
    import torch.distributed as td
    from ..os_support import host_memory
    peak = host_memory()[1]
    before = load_memory.get("rss_before")
    rise = peak - before if peak is not None and before is not None else None
    rises = [rise]
    if td.is_available() and td.is_initialized():
        rises = [None] * td.get_world_size()
        td.all_gather_object(rises, rise)
    return {"peak": peak, "rank_rises": rises} if peak is not None else {"rank_rises": rises}
