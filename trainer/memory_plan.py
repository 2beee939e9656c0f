"""The memory plan: a run's peak device memory and host RAM, predicted before the engine puts anything on the
device, from the model's own modules and one forward pass run on the meta device (shapes only, no memory, about
a second for SD1.5); the settings "auto" chooses to fit; and the refusal, naming the numbers, when nothing does.

What a step holds at its peak, the way the trainer lays it out:
- the frozen weights that stay on the device, in the precision the engine gives them (fp8 stays fp8), plus, with
  block swap, the swapped block on its visit (its frozen weights live in host memory);
- the trained weights, their gradients, the optimizer's fp32 master copies (bf16 and fp16 training) and its
  state (per optimizer, OPTIMIZER_STATE_BYTES);
- the activations autograd saves, measured per block on the meta device at the largest item's size and the
  micro-batch: with checkpointing, a checkpointed block keeps only its inputs, and one block's activations live
  again while the backward pass recomputes it;
- the backward pass's working set: the gradients of one block's activations while they flow through it
  (calibrated against measured peaks, bench/memory_plan.py);
- or, where it is more (a full fine-tune), the optimizer step's instead of the last two: the fp32 masters'
  gradients beside the low-precision ones.
A weight handed to a matmul or convolution (a parameter, or ComfyUI's cast copy of an fp8 one, which
memory.keep_fp8_weights_for_backward does not keep) is a weight, never an activation.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
import dataclasses
from dataclasses import dataclass, field

import torch

from .distributed import global_min, uses_deepspeed

GiB = 2 ** 30


def low_precision_dtype(precision: str):
    """The dtype the engine casts the model to (bf16, fp16); None for fp32."""
    from .models import PRECISION_DTYPES
    return None if precision == "fp32" else getattr(torch, PRECISION_DTYPES[precision])

# bytes of optimizer state per trained parameter (fp32 moments; 8-bit AdamW's two 1-byte moments; the factored
# optimizers keep one fp32 moment and row/column statistics, which are small)
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "prodigy": 16, "adafactor": 4, "came": 4, "lion": 4,
                         "adamw_schedulefree": 8}
MARGIN = 0.9  # of the free memory, a plan may use (the allocator's fragmentation, the CUDA context's growth)
# x the largest block's saved activations: the gradients flowing back through it and the block's own scratch
# (fitted on the full SD1.5 UNet at 512 px with and without checkpointing, bench/memory_plan.py)
BACKWARD_WORKING_SET = 2.5
HOST_RUNTIME = 128 * 2 ** 20  # a CPU run's own allocations beside the model's (the dataset, autograd's records)


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


@dataclass
class MemoryPlan:
    device: str  # "cuda" or "cpu"
    checkpointing: bool
    block_swap: int
    parts: dict  # name -> bytes on the device at the peak
    host_parts: dict  # name -> bytes of host RAM the run holds besides (swapped weights)
    budget: int | None  # bytes the device may hold (free memory x MARGIN, or the spec's budget); None: unknown
    notes: list = field(default_factory=list)
    activations_measured: bool = True

    @property
    def device_peak(self) -> int:
        return sum(self.parts.values())

    @property
    def host_peak(self) -> int:
        """On a CPU the device is the host: everything counts once."""
        return sum(self.host_parts.values()) + (self.device_peak if self.device == "cpu" else 0)

    @property
    def peak(self) -> int:
        """What the budget bounds: the device's peak; on a CPU, everything the run holds."""
        return self.host_peak if self.device == "cpu" else self.device_peak

    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.budget

    def summary(self) -> str:
        where = "GPU" if self.device == "cuda" else "CPU"
        parts = ", ".join(f"{name} {size / GiB:.2f}" for name, size in self.parts.items() if size)
        budget = f" of {self.budget / GiB:.2f} GiB allowed" if self.budget is not None else ""
        swapped = f"; {self.host_parts.get('swapped weights', 0) / GiB:.2f} GiB of weights swapped to host " \
                  f"memory ({self.block_swap} blocks)" if self.block_swap else ""
        unknown = "" if self.activations_measured else "; activations not measured (not counted)"
        return (f"memory plan: {self.peak / GiB:.2f} GiB on the {where}{budget} ({parts} GiB); "
                f"gradient checkpointing {'on' if self.checkpointing else 'off'}{swapped}{unknown}")

    def as_event(self) -> dict:
        return {"summary": self.summary(), "device": self.device, "device_peak": self.device_peak, "host_peak": self.host_peak,
                "budget": self.budget, "parts": dict(self.parts), "host_parts": dict(self.host_parts),
                "gradient_checkpointing": self.checkpointing, "block_swap": self.block_swap}


class MemoryPlanRefused(ValueError):
    """The run needs more memory than the device (or the spec's budget) has, with every setting it may change."""


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
    from .comfy_compat import free_memory_answers_for
    with free_memory_answers_for(torch.device("meta"), device):
        yield


def activation_profile(family, model_inputs, blocks, compute_dtype, device) -> ActivationProfile:
    """Runs the diffusion model once on the meta device with these inputs (x, timestep, kwargs, as
    family.model_inputs makes them) and the trained/frozen pattern of the real weights, in `compute_dtype`
    (the engine's precision; fp8 and integer weights stay as they are), counting what autograd saves."""
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
    from .memory import WeightArguments
    x, timestep, kwargs = _meta(model_inputs)
    if compute_dtype is not None and x.is_floating_point():
        x = x.to(compute_dtype)
    operands: set = set()
    try:
        with _attention_as_on(device), WeightArguments(operands, key=operand_key, frozen_only=False), \
                _FusedAttentionOnMeta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch.func.functional_call(model, weights, (x, timestep), {"transformer_options": {}, **kwargs},
                                             strict=False)
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
    from .comfy_compat import is_quantized, tensor_bytes
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
    pinned_per_block: list[int] = field(default_factory=list)  # the frozen bytes once pinned (powers of two)


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
    return ModelBytes(rest + sum(per_block), per_block, trained_bytes, sum(p.numel() for p in trained),
                      pinned_per_block=pinned)


def _pinned_bytes(tensor: torch.Tensor, compute_dtype) -> int:
    size = _held_bytes(tensor, compute_dtype)
    return 1 << (size - 1).bit_length() if size > 1 else size


def plan_for(spec, weights: ModelBytes, profile: ActivationProfile, checkpointing: bool, block_swap: int,
             device_type: str, budget: int | None) -> MemoryPlan:
    t = spec.train
    low_precision = t.precision in ("bf16", "fp16")
    n = len(profile.saved)
    swapped = sum(weights.frozen_per_block[:block_swap])
    checkpointed = n if checkpointing else block_swap  # swapped blocks are checkpointed by the swap itself
    # the checkpointed blocks are the first ones (memory_savers checkpoints blocks[swap:], swaps blocks[:swap])
    parts = {
        # under DeepSpeed the engine moves the whole model to the device before block swap takes the blocks out
        "weights": weights.frozen - (swapped if device_type == "cuda" and not uses_deepspeed(spec) else 0),
        # the swapped block computing, the one before it finishing, the next on its way (memory.BlockCopies.bound)
        "swapped blocks": 3 * max(weights.frozen_per_block[:block_swap], default=0) if device_type == "cuda" else 0,
        "trained": weights.trained,
        "gradients": weights.trained // weights.gradient_share,
    }
    # the fp32 masters, the optimizer's state and (at its step) the masters' gradients: this process's share, on
    # the device or, offloaded, in host memory
    state = {"master weights": 4 * weights.trained_count if low_precision else 0,
             "optimizer": OPTIMIZER_STATE_BYTES.get(t.optimizer, 8) * weights.trained_count}
    state = {k: v // weights.state_share for k, v in state.items()}
    master_gradients = (4 * weights.trained_count if low_precision else 0) // weights.state_share
    # pinned host memory: PyTorch's pinned allocator rounds each tensor up to a power of two
    host = {"swapped weights": sum(weights.pinned_per_block[:block_swap])} if device_type == "cuda" else \
        {"runtime": HOST_RUNTIME}
    if weights.offloaded:
        host["offloaded optimizer"] = sum(state.values()) + master_gradients
        master_gradients = 0
    else:
        parts.update(state)
    # the peak is in the backward pass (the activations and the gradients flowing through them) or at the optimizer
    # step, where the fp32 masters' gradients are filled beside the low-precision ones (a full fine-tune's peak)
    backward = {"activations": profile.held(checkpointed) + profile.recomputed(checkpointed),
                "backward": profile.working_set()}
    step = {"master gradients": master_gradients}
    parts.update(backward if sum(backward.values()) >= sum(step.values()) else step)
    return MemoryPlan(device_type, checkpointing, block_swap, parts, host, budget,
                      activations_measured=profile.measured)


def swap_allowed(spec) -> bool:
    """Where block swap may be chosen to fit the device: adapter training in the plain engine (DeepSpeed's engine
    moves the whole model to the device first, so a swap lowers its steps' memory but not its start-up peak)."""
    return spec.adapter.kind != "full" and not uses_deepspeed(spec)


def choose(spec, weights: ModelBytes, profile: ActivationProfile, device_type: str, budget: int | None):
    """The plan of the spec's own settings ("manual"), or ("auto") the cheapest in speed that fits the budget:
    as given, then with checkpointing, then with checkpointing and 1, 2, ... swapped blocks (on a GPU). With
    nothing fitting, the plan of the most frugal setting tried, so the refusal can say what it would need."""
    t, d = spec.train, spec.distributed
    given = plan_for(spec, weights, profile, t.gradient_checkpointing, d.block_swap, device_type, budget)
    if t.memory != "auto" or given.fits() or not profile.saved or not profile.measured:
        return given  # no blocks to checkpoint or swap; or activations unknown: no ground to change anything
    tried = [plan_for(spec, weights, profile, True, d.block_swap, device_type, budget)]
    if device_type == "cuda" and swap_allowed(spec):
        tried += [plan_for(spec, weights, profile, True, k, device_type, budget)
                  for k in range(d.block_swap + 1, len(profile.saved) + 1)]
    for plan in tried:
        if plan.fits():
            plan.notes.append(f"memory auto: gradient checkpointing on"
                              + (f", block_swap {plan.block_swap}" if plan.block_swap != d.block_swap else "")
                              + f" (as given the run needs {given.peak / GiB:.2f} GiB)")
            return plan
    return min(tried, key=lambda p: p.peak)


def suggestions(spec, plan: MemoryPlan, weights: ModelBytes, profile: ActivationProfile) -> list[str]:
    """What would bring the run within the plan's budget, cheapest in speed first: checkpointing where it alone
    fits, else the fewest swapped blocks that do (the plain engine on a GPU), then what the plan cannot size
    (an fp8 base, a smaller batch, a lower resolution)."""
    from .memory import memory_suggestions
    checkpointing_fits = bool(profile.saved) and plan_for(spec, weights, profile, True, spec.distributed.block_swap,
                                                          plan.device, plan.budget).fits()
    what = [s for s in memory_suggestions(spec)
            if "block_swap" not in s and ("gradient_checkpointing" not in s or checkpointing_fits)]
    if plan.device == "cuda" and swap_allowed(spec) and not checkpointing_fits:
        more = [k for k in range(1, len(profile.saved) + 1)
                if plan_for(spec, weights, profile, True, k, plan.device, plan.budget).fits()]
        if more:
            what.insert(0, f"set gradient_checkpointing on and block_swap to {more[0]} or more")
    return what


def _need(plan: MemoryPlan) -> str:
    where = "GPU" if plan.device == "cuda" else "CPU"
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in plan.parts.items() if v)
    return f"{plan.peak / GiB:.1f} GiB on the {where} ({parts} GiB)"


def _settings(plan: MemoryPlan) -> str:
    return f"gradient checkpointing {'on' if plan.checkpointing else 'off'}" + \
        (f" and {plan.block_swap} blocks swapped" if plan.block_swap else "")


def _allowed(spec, plan: MemoryPlan) -> str:
    source = "memory_budget_gb" if spec.train.memory_budget_gb else f"{MARGIN:.0%} of the free memory"
    return f"{plan.budget / GiB:.1f} GiB may be used ({source})"


def refusal(spec, plan: MemoryPlan, weights: ModelBytes, profile: ActivationProfile) -> str:
    """memory "auto" with nothing fitting: the most frugal plan tried, the budget and what else would do."""
    return (f"not enough memory: with {_settings(plan)} the run needs {_need(plan)} and {_allowed(spec, plan)}: "
            + "; or ".join(suggestions(spec, plan, weights, profile)) + ". Nothing was moved to the device.")


def warning(spec, plan: MemoryPlan, weights: ModelBytes, profile: ActivationProfile) -> str:
    """memory "manual" beyond the budget: a prediction, and the run goes on."""
    return (f"the memory plan predicts {_need(plan)} with {_settings(plan)}, and {_allowed(spec, plan)}: "
            + "; or ".join(suggestions(spec, plan, weights, profile)) + ". The run starts anyway (memory "
            "'manual') and may run out of memory.")


def device_budget(spec, device, held: int) -> int | None:
    """The bytes the plan may fill: train.memory_budget_gb where set (tests simulate a card with it); else the
    device's free memory x MARGIN; on a CPU the RAM available now x MARGIN plus `held`, what this process already
    holds of the model (the plan counts the loaded weights)."""
    if spec.train.memory_budget_gb:
        return int(spec.train.memory_budget_gb * GiB)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * MARGIN)
    from .os_support import available_memory
    available = available_memory()
    return None if available is None else int(available * MARGIN) + held


def device_capacity(device) -> int | None:
    """All the memory the device has (the card's total; on a CPU, the machine's RAM): what no setting elsewhere
    can free more of."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    from .os_support import total_memory
    return total_memory()


def beyond_the_machine(spec, plan: MemoryPlan, weights: ModelBytes, profile: ActivationProfile,
                       capacity: int | None) -> str | None:
    """Why a run cannot start whatever else is freed, memory "manual" included (a client of a shared server asks
    for batch 1024 at 4096 px, say): its plan exceeds all the device's memory. None where it does not."""
    if capacity is None or plan.peak <= capacity:
        return None
    where = "GPU" if plan.device == "cuda" else "machine"
    everything = dataclasses.replace(plan, budget=capacity)
    return (f"not enough memory: with {_settings(plan)} the run needs {_need(plan)} and this {where} has "
            f"{capacity / GiB:.1f} GiB in all: " + "; or ".join(suggestions(spec, everything, weights, profile))
            + ". Nothing was moved to the device.")


def largest_item_inputs(family, dataset, batch_size: int):
    """family.model_inputs of a micro-batch of the dataset's largest item (by latent size), repeated: the
    step whose activations are largest. No random draw is made (the run's streams stay as they are)."""
    from .batch_mix import training_batch
    from .models import Batch
    sizes = [torch.Size(b).numel() for b in dataset.buckets]
    largest = max(range(len(sizes)), key=sizes.__getitem__)
    b = training_batch(dataset, [largest] * batch_size)
    zeros = torch.zeros_like(b.latents)
    batch = Batch(b.latents, b.cond, b.pooled, zeros, torch.full((batch_size,), 0.5), b.mask,
                  b.references, b.text_mask)
    with torch.no_grad():
        return family.model_inputs(batch)


def plan_memory(spec, family, dataset, device, data_parallel: int, log) -> MemoryPlan:
    """The run's memory plan, with "auto"'s choice of checkpointing and block swap; refuses (MemoryPlanRefused)
    an "auto" run nothing fits and any run beyond all the device's memory, and warns of a "manual" one that may not
    fit what is free. `log(level, message)` reports "auto"'s choices and the
    warnings to the node; the plan itself goes out in the started event (as_event)."""
    compute_dtype = low_precision_dtype(spec.train.precision)
    try:
        blocks = family.checkpoint_blocks()
    except ValueError:  # a model the generic family finds no block list in: nothing to checkpoint or swap
        blocks = []
    # a resume of an "auto" run keeps what it began with ("manual": the settings as given, as always)
    began_with = earlier_choice(spec, len(blocks)) if spec.train.resume and spec.train.memory == "auto" else None
    if began_with is not None:  # a resume keeps the settings the run began with: its numbers stay the run's own
        checkpointing, block_swap = began_with
        log("info", f"memory: the settings this run began with (gradient checkpointing "
                    f"{'on' if checkpointing else 'off'}, block_swap {block_swap})")
        spec = dataclasses.replace(
            spec, train=dataclasses.replace(spec.train, gradient_checkpointing=checkpointing, memory="manual"),
            distributed=dataclasses.replace(spec.distributed, block_swap=block_swap))
    t, d = spec.train, spec.distributed
    weights = model_bytes(family.diffusion_model, blocks, compute_dtype)
    try:
        with torch.random.fork_rng(devices=[]):
            profile = activation_profile(family, largest_item_inputs(family, dataset, t.batch_size), blocks,
                                         compute_dtype, device)
    except Exception as e:  # a model whose forward the meta device cannot run: plan the weights alone
        log("warning", f"memory plan: activations not measured ({type(e).__name__}: {e}); the plan counts "
                       f"weights and optimizer state only")
        profile = ActivationProfile(0, [0] * len(blocks), [0] * len(blocks), measured=False)
    weights = _shared_out(weights, d.zero_stage, data_parallel, d.pipeline_stages, d.offload_optimizer)
    budget = device_budget(spec, device, weights.frozen if device.type == "cpu" else 0)
    # every process decides alike (one refusing while the others wait in a collective would hang the run)
    budget = global_min(math.inf if budget is None else budget, device)
    budget = None if math.isinf(budget) else int(budget)
    plan = choose(spec, weights, profile, device.type, budget)
    for note in plan.notes:
        log("info", note)
    capacity = device_capacity(device)
    capacity = None if capacity is None else int(global_min(capacity, device))
    impossible = beyond_the_machine(spec, plan, weights, profile, capacity)
    if impossible:
        raise MemoryPlanRefused(impossible)
    if not plan.fits():
        if t.memory == "auto":
            raise MemoryPlanRefused(refusal(spec, plan, weights, profile))
        log("warning", warning(spec, plan, weights, profile))
    if began_with is None:
        record_choice(spec, plan)
    return plan


def earlier_choice(spec, blocks: int) -> tuple[bool, int] | None:
    """(gradient checkpointing, block swap) as the run began, from its signed record; None without one (a run
    from before the plan, or a record this installation did not sign)."""
    from .layout import MEMORY_CHOICE_FILE
    from .trust import TrustError, read_signed_json
    try:
        found = read_signed_json(Path(spec.run_dir) / MEMORY_CHOICE_FILE, max_bytes=4096)
    except (TrustError, OSError, ValueError):
        return None
    checkpointing, swap = found.get("gradient_checkpointing"), found.get("block_swap")
    if found.get("run") != Path(spec.run_dir).name or not isinstance(checkpointing, bool) \
            or not isinstance(swap, int) or isinstance(swap, bool) or not 0 <= swap <= blocks:
        return None
    return checkpointing, swap


def record_choice(spec, plan: MemoryPlan) -> None:
    from .distributed import rank
    from .layout import MEMORY_CHOICE_FILE
    from .trust import write_signed_json
    if rank() == 0:
        write_signed_json(Path(spec.run_dir) / MEMORY_CHOICE_FILE,
                          {"run": Path(spec.run_dir).name, "gradient_checkpointing": plan.checkpointing,
                           "block_swap": plan.block_swap})


def _shared_out(weights: ModelBytes, zero_stage: int, data_parallel: int, stages: int,
                offload: bool) -> ModelBytes:
    """One process's share: ZeRO 1 partitions the masters and optimizer state over the data-parallel processes,
    ZeRO 2 the gradients too, ZeRO 3 the weights as well; pipeline stages split the blocks (evenly, an estimate);
    optimizer offload keeps the masters and optimizer state in host memory."""
    shares = {}
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


DIFFUSION_MODEL_PREFIX = "model.diffusion_model."  # a whole checkpoint's diffusion model keys


def load_bytes(model, precision: str) -> int | None:
    """The host bytes the diffusion model will hold once loaded, from the file's header alone (no weight is read):
    its tensors (a checkpoint's diffusion-model keys only) in the precision the trainer holds them: fp8 where the
    file has fp8 or the spec asks for an fp8 base (matrices and convolutions; ComfyUI keeps biases and norms in the
    compute precision), other floats in the training precision, anything else (a quantized layout's packed data,
    integers) as stored. None where the header cannot be read (ComfyUI's loader then says what is wrong)."""
    import json
    import struct
    try:
        with open(model.path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > 100 * 2**20:  # safetensors' own limit on a header
                return None
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            return None
    except (OSError, ValueError, struct.error):
        return None
    header.pop("__metadata__", None)
    if model.format == "checkpoint" and any(k.startswith(DIFFUSION_MODEL_PREFIX) for k in header):
        header = {k: v for k, v in header.items() if k.startswith(DIFFUSION_MODEL_PREFIX)}
    wide = {"fp32": 4}.get(precision, 2)
    fp8_base = model.weight_dtype.startswith("fp8") or model.base_precision == "fp8"
    total = 0
    for info in header.values():
        start, end = info["data_offsets"]
        stored, numel = end - start, 1
        for n in info["shape"]:
            numel *= n
        dtype = info["dtype"]
        if dtype.startswith("F8"):
            total += numel
        elif dtype in ("F16", "BF16", "F32", "F64"):
            total += numel * (1 if fp8_base and len(info["shape"]) >= 2 else wide)
        else:
            total += stored
    return total


def host_refusal(model, precision: str, full: bool = False, processes: int = 1) -> str | None:
    """Before the load: the reason the model cannot be loaded into this machine's RAM by the `processes` of the
    run on it (each loads its own copy), naming the file and the numbers; None where it fits, or where the system
    or the file's header tells nothing. `full`: a full fine-tune (which cannot take an fp8 base)."""
    from .os_support import available_memory
    available = available_memory()
    one = load_bytes(model, precision)
    if available is None or one is None:
        return None
    needed = one * processes
    if needed <= available * MARGIN:
        return None
    each = f" ({processes} processes on this machine, {one / GiB:.1f} GiB each)" if processes > 1 else ""
    fp8 = "" if (full or model.weight_dtype.startswith("fp8") or model.base_precision == "fp8") else \
        "set base_precision to fp8 (half the bytes of bf16), or "
    return (f"not enough memory: loading {model.path} needs {needed / GiB:.1f} GiB of RAM{each} and "
            f"{available / GiB:.1f} GiB is available: {fp8}close other programs. Nothing was loaded.")
