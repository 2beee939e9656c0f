"""What a run's memory is made of, measured without spending it: the weights as the engine will hold them (per
checkpoint block, and pinned where block swap keeps them in host memory), the activations autograd saves, from one
forward pass on the meta device, the bytes a model file's load will hold, from its header alone, and one process's
share of the weights and state under ZeRO, pipeline stages and offload. The memory plan
(memory_plan.py) turns these into a run's peak and its choices.

The meta pass runs the real module tree (torch.func.functional_call with meta tensors, the real trained/frozen
pattern) on the largest item at the run's micro-batch, and records per checkpoint block what autograd saves and
what the block is called with, so that checkpointing or N swapped blocks are arithmetic. A tensor handed to a matmul
or convolution as its weight is a weight (a parameter, or ComfyUI's cast copy of an fp8 one, which
memory.keep_fp8_weights_for_backward does not keep), never an activation.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field

import torch

# x the largest block's saved activations: the gradients flowing back through it and the block's own scratch
# (fitted on the full SD1.5 UNet at 512 px with and without checkpointing, bench/memory_plan.py)
BACKWARD_WORKING_SET = 2.5


def low_precision_dtype(precision: str):
    """The dtype the engine casts the model to (bf16, fp16); None for fp32."""
    from ..models import PRECISION_DTYPES
    return None if precision == "fp32" else getattr(torch, PRECISION_DTYPES[precision])


@dataclass
class ActivationProfile:
    """What one forward pass saves for backward, in bytes: outside the blocks, and per block (its saved
    activations, and the inputs it is called with: all a checkpointed block keeps)."""
    outside: int
    saved: list[int]
    inputs: list[int]
    loss: int = 0  # the loss's own tensors (the output, its target and their difference, in fp32)
    measured: bool = True  # False: the meta pass failed, and these are zeros

    def held(self, checkpointed: int) -> int:
        """Saved bytes at the end of the forward pass with blocks [swap:] ... checkpointed: the first
        `checkpointed` entries of the block list keep their inputs only."""
        kept = sum(self.inputs[:checkpointed]) + sum(self.saved[checkpointed:])
        return self.outside + self.loss + kept

    def recomputed(self, checkpointed: int) -> int:
        """The largest block's activations alive again in backward (checkpointed blocks only)."""
        return max(self.saved[:checkpointed], default=0)

    def working_set(self) -> int:
        return int(BACKWARD_WORKING_SET * max(self.saved, default=0))


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata  # one StorageImpl per storage, on meta too (where data_ptr is 0)


class _FusedAttentionOnMeta(torch.overrides.TorchFunctionMode):
    """PyTorch's scaled_dot_product_attention on the meta device takes its math path, which saves the whole
    heads x tokens x tokens matrix, where a real run takes a fused kernel (flash or memory-efficient, on a GPU and
    on a CPU alike) that saves only q, k, v, the output and a statistic per row. Within: a meta call goes to the
    memory-efficient kernel, so the meta pass saves what the real one does. Anything it cannot take (a grouped
    query layout) stays on the math path, an overestimate."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and args and args[0].device.type == "meta" \
                and not kwargs.get("enable_gqa"):
            try:
                return _efficient_attention(*args, **kwargs)
            except (RuntimeError, TypeError, ValueError):
                pass
        return func(*args, **kwargs)


def _efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, True, dropout_p,
                                                                   is_causal, scale=scale)[0]


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta").requires_grad_(value.requires_grad)
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@contextlib.contextmanager
def _attention_as_on(device):
    """ComfyUI picks its attention split by the device's free memory; on the meta device it would ask CUDA.
    Within: the meta device's free memory is the training device's, so the meta pass takes the same path."""
    from ..comfy_compat import free_memory_answers_for
    with free_memory_answers_for(torch.device("meta"), device):
        yield


def activation_profile(family, model_inputs, blocks, compute_dtype, device) -> ActivationProfile:
    """Runs the diffusion model once on the meta device with these inputs (x, timestep, kwargs, as
    family.model_inputs makes them), called as the family calls it (family.run_model: a packed audio-video latent
    unpacked into its streams), with the trained/frozen pattern of the real weights, in `compute_dtype` (the
    engine's precision; fp8 and integer weights stay as they are), counting what autograd saves."""
    model = family.diffusion_model
    weights = {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        dtype = compute_dtype if (compute_dtype is not None and p.is_floating_point() and p.element_size() > 1) \
            else p.dtype
        weights[name] = torch.empty(p.shape, dtype=dtype, device="meta").requires_grad_(p.requires_grad)
    weight_keys = {_storage_key(t) for t in weights.values()}
    saved: dict = {}  # storage -> (bytes, block index or None)
    current = [None]
    inputs = [0] * len(blocks)
    kept = []  # every tensor seen, alive to the end: no storage is freed and its key reused by another meanwhile

    def pack(t):
        key = _storage_key(t)
        if key not in saved:
            saved[key] = (t.untyped_storage().nbytes(), current[0])
            kept.append(t)
        return t

    def operand_key(t):
        kept.append(t)
        return _storage_key(t)

    hooks = []
    for i, block in enumerate(blocks):
        def enter(module, args, kwargs, _i=i):
            current[0] = _i
            inputs[_i] = max(inputs[_i], _tensor_bytes(args) + _tensor_bytes(kwargs))

        def leave(module, args, output):
            current[0] = None
        hooks.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        hooks.append(block.register_forward_hook(leave))
    from torch.nn.utils.stateless import _reparametrize_module  # torch.func.functional_call's own, around any call

    from .memory import WeightArguments
    x, timestep, kwargs = _meta(model_inputs)
    if family.reads_timestep_value:  # a meta tensor has no value to read
        timestep = model_inputs[1]
    if compute_dtype is not None and x.is_floating_point():
        x = x.to(compute_dtype)
    operands: set = set()
    try:
        # a frozen weight's cast copy is left out (an fp8 layer casts it again for the backward pass); a weight
        # computed from trained ones (LoKr's and LoHa's whole change of a layer) is saved for real, and counted
        with _attention_as_on(device), WeightArguments(operands, key=operand_key), \
                _FusedAttentionOnMeta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with _reparametrize_module(model, weights, tie_weights=True):  # as functional_call's default
                out = family.run_model(x, timestep, kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    per_block = [0] * len(blocks)
    outside = 0
    for key, (size, block) in saved.items():
        if key in weight_keys or key in operands:
            continue
        if block is None:
            outside += size
        else:
            per_block[block] += size
    return ActivationProfile(outside, per_block, inputs, loss=3 * out.numel() * 4)


def _held_bytes(tensor: torch.Tensor, compute_dtype) -> int:
    """A frozen tensor's bytes once the engine has cast it (floats wider than a byte to the training precision;
    fp8, integers and ComfyUI's quantized layouts stay as they are)."""
    from ..comfy_compat import is_quantized, tensor_bytes
    if is_quantized(tensor):
        return tensor_bytes(tensor)
    if compute_dtype is not None and tensor.is_floating_point() and tensor.element_size() > 1:
        return tensor.numel() * torch.empty((), dtype=compute_dtype).element_size()
    return tensor.numel() * tensor.element_size()


@dataclass
class ModelBytes:
    frozen: int  # frozen weights and buffers, as the engine holds them
    frozen_per_block: list[int]  # of the checkpoint blocks, in order
    trained: int  # trained parameters (numel x their dtype once cast)
    trained_count: int
    state_share: int = 1  # ZeRO 1+: this process holds 1/state_share of the fp32 masters and optimizer state
    gradient_share: int = 1  # ZeRO 2+: and of the gradients
    offloaded: bool = False  # distributed.offload_optimizer: masters and optimizer state in host memory
    weights_offloaded: bool = False  # distributed.offload_params: the frozen share in host memory, fetched per block
    gathered: int = 0  # ZeRO 3: the weights' bytes gathered whole on a process at the peak (DEEPSPEED_LIVE_PARAMETERS)
    pinned_per_block: list[int] = field(default_factory=list)  # the frozen bytes once pinned (powers of two)
    frozen_count: int = 0  # frozen parameters' elements (0: unknown)


# DeepSpeed's stage3_max_live_parameters and stage3_max_reuse_distance, which the run's config leaves at their default:
# a gathered weight used again within this many parameters (a forward's weights, by the backward) stays gathered, up to
# this many in all, so a model smaller than it ends its forward pass whole on every process
DEEPSPEED_LIVE_PARAMETERS = 10 ** 9


def model_bytes(model, blocks, compute_dtype) -> ModelBytes:
    seen = set()

    def frozen_in(module) -> int:
        total = 0
        for t in [*module.parameters(), *module.buffers()]:
            key = _storage_key(t)
            if t.requires_grad or key in seen:
                continue
            seen.add(key)
            total += _held_bytes(t, compute_dtype)
        return total
    pinned = []
    for block in blocks:  # a swapped block's parameters are pinned (memory.enable_block_swap), its buffers not
        pinned.append(sum(_pinned_bytes(p, compute_dtype) for p in block.parameters() if not p.requires_grad))
    per_block = [frozen_in(block) for block in blocks]
    rest = frozen_in(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    element = torch.empty((), dtype=compute_dtype).element_size() if compute_dtype is not None else None
    trained_bytes = sum(p.numel() * (element or p.element_size()) for p in trained)
    frozen_params = {_storage_key(p): p.numel() for p in model.parameters() if not p.requires_grad}
    return ModelBytes(rest + sum(per_block), per_block, trained_bytes, sum(p.numel() for p in trained),
                      pinned_per_block=pinned, frozen_count=sum(frozen_params.values()))


def _pinned_bytes(tensor: torch.Tensor, compute_dtype) -> int:
    size = _held_bytes(tensor, compute_dtype)
    return 1 << (size - 1).bit_length() if size > 1 else size


def caption_tokens(part, j: int) -> int:
    """The token count of item j's caption as written (of a CachedDataset), from its text shard's header (no tensor
    is read); 0 where the header cannot be read (the run's own read then says what is wrong)."""
    from ...cache.files import safetensors_header
    from ...cache.shards import entry_path
    try:
        header = safetensors_header(entry_path(part.root, "text", part.text_keys[j]))
    except ValueError:
        return 0
    shape = ((header or {}).get("cond") or {}).get("shape") or [0]
    return int(shape[0])


def largest_items(dataset) -> list[int]:
    """The items whose step may save the most activations: the largest latent (the longest caption among those),
    and, where it is another item, the longest caption (the largest latent among those). A DiT attends over image
    and text tokens together and a UNet's cross-attention over both, so a long caption on a small image can
    outweigh a short one on a large image; the plan measures each and keeps the larger."""
    from ..data.batch_mix import locate
    sizes = [torch.Size(b).numel() for b in dataset.buckets]
    known: dict[tuple, int] = {}  # (dataset part, text key) -> tokens: items sharing a caption share a shard
    tokens = []
    for i in range(len(sizes)):
        part, j = locate(dataset, i)
        key = (id(part), part.text_keys[j])
        if key not in known:
            known[key] = caption_tokens(part, j)
        tokens.append(known[key])
    by_latent = max(range(len(sizes)), key=lambda i: (sizes[i], tokens[i]))
    by_text = max(range(len(sizes)), key=lambda i: (tokens[i], sizes[i]))
    return [by_latent] if tokens[by_text] <= tokens[by_latent] else [by_latent, by_text]


def item_inputs(family, dataset, item: int, batch_size: int):
    """family.model_inputs of a micro-batch of one item, repeated: what a step on it runs. No random draw is made
    (the run's streams stay as they are)."""
    from ..data.batch_mix import training_batch
    from ..models import Batch
    b = training_batch(dataset, [item] * batch_size)
    zeros = torch.zeros_like(b.latents)
    batch = Batch(b.latents, b.cond, b.pooled, zeros, torch.full((batch_size,), 0.5), b.mask,
                  b.references, b.text_mask, b.text_extras, b.audio,
                  torch.zeros_like(b.audio) if b.audio is not None else None)  # the audio stream runs too
    with torch.no_grad():
        return family.model_inputs(batch)


def largest_activation_profile(family, dataset, batch_size: int, blocks, compute_dtype, device) -> ActivationProfile:
    """What the step that saves the most saves: largest_items, each measured, and of every part (each block's saved
    activations and inputs, what lies outside the blocks) the larger, so that whichever checkpointing or swap the
    plan weighs, neither candidate needs more than it counts."""
    profiles = [activation_profile(family, item_inputs(family, dataset, item, batch_size), blocks, compute_dtype,
                                   device) for item in largest_items(dataset)]
    return ActivationProfile(max(p.outside for p in profiles), [max(s) for s in zip(*(p.saved for p in profiles))],
                             [max(i) for i in zip(*(p.inputs for p in profiles))], max(p.loss for p in profiles),
                             measured=all(p.measured for p in profiles))


DIFFUSION_MODEL_PREFIX = "model.diffusion_model."  # a whole checkpoint's diffusion model keys


def load_bytes(model, precision: str) -> int | None:
    """The host bytes the diffusion model will hold once loaded, from the file's header alone (no weight is read):
    its tensors (a checkpoint's diffusion-model keys only) in the precision the trainer holds them: fp8 where the
    file has fp8 or the spec asks for an fp8 base (matrices and convolutions; ComfyUI keeps biases and norms in the
    compute precision), other floats in the training precision, anything else (a quantized layout's packed data,
    integers) as stored. None where the header cannot be read (ComfyUI's loader then says what is wrong)."""
    from ...cache.files import safetensors_header
    header = safetensors_header(model.path)
    if header is None:
        return None
    header.pop("__metadata__", None)
    if model.format == "checkpoint" and any(k.startswith(DIFFUSION_MODEL_PREFIX) for k in header):
        header = {k: v for k, v in header.items() if k.startswith(DIFFUSION_MODEL_PREFIX)}
    wide = {"fp32": 4}.get(precision, 2)
    fp8_base = model.weight_dtype.startswith("fp8") or model.base_precision == "fp8"
    total = 0
    for info in header.values():
        start, end = info["data_offsets"]
        stored, numel = end - start, math.prod(info["shape"])
        dtype = info["dtype"]
        if dtype.startswith("F8"):
            total += numel
        elif dtype in ("F16", "BF16", "F32", "F64"):
            total += numel * (1 if fp8_base and len(info["shape"]) >= 2 else wide)
        else:
            total += stored
    return total


def shared_out(weights: ModelBytes, zero_stage: int, data_parallel: int, stages: int,
               offload: bool, offload_params: bool = False) -> ModelBytes:
    """One process's share: ZeRO 1 partitions the masters and optimizer state over the data-parallel processes,
    ZeRO 2 the gradients too, ZeRO 3 the weights as well; pipeline stages split the blocks (evenly, an estimate);
    optimizer offload keeps the masters and optimizer state in host memory, weight offload (ZeRO 3) the weights."""
    shares = {}
    if zero_stage >= 3 and (data_parallel > 1 or offload_params):  # weights are gathered whole to compute
        count = weights.frozen_count + weights.trained_count  # a full fine-tune's trained weights are gathered too
        live = min(1.0, DEEPSPEED_LIVE_PARAMETERS / count) if count else 1.0
        shares["gathered"] = int((weights.frozen + weights.trained) * live)
    if offload_params and zero_stage >= 3:
        shares["weights_offloaded"] = True
    if data_parallel > 1 and zero_stage >= 1:
        shares["state_share"] = data_parallel
    if data_parallel > 1 and zero_stage == 2:  # ZeRO 3's gradients are its divided trained weights' already
        shares["gradient_share"] = data_parallel
    if zero_stage >= 3 and data_parallel > 1:
        weights = dataclasses.replace(weights, frozen=weights.frozen // data_parallel,
                                      frozen_per_block=[b // data_parallel for b in weights.frozen_per_block],
                                      trained=weights.trained // data_parallel)
    elif stages > 1:
        weights = dataclasses.replace(weights, frozen=weights.frozen // stages, trained=weights.trained // stages,
                                      trained_count=weights.trained_count // stages)
    return dataclasses.replace(weights, offloaded=offload, **shares)
