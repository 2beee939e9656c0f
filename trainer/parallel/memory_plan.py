"""The memory plan: a run's peak device memory and host RAM, predicted before the engine puts anything on the
device from what memory_sizes measures (the model's own modules, and one forward pass on the meta device: shapes
only, no memory, about a second for SD1.5); the settings "auto" chooses to fit; and the refusal, naming the
numbers, when nothing does.

What a step holds at its peak, the way the trainer lays it out:
- the frozen weights that stay on the device, in the precision the engine gives them (fp8 stays fp8), plus, with
  block swap, the swapped block on its visit (its frozen weights live in host memory);
- the trained weights, their gradients, the optimizer's fp32 master copies (bf16 and fp16 training) and its
  state (per optimizer, its record's state_bytes);
- the activations autograd saves, measured per block on the meta device at the largest item's size and the
  micro-batch: with checkpointing, a checkpointed block keeps only its inputs, and one block's activations live
  again while the backward pass recomputes it;
- the backward pass's working set: the gradients of one block's activations while they flow through it
  (calibrated against measured peaks, bench/memory_plan.py);
- or, where it is more (a full fine-tune), the optimizer step's instead of the last two: the fp32 masters'
  gradients beside the low-precision ones.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .distributed import global_min
from .memory import memory_suggestions, swap_allowed
from .memory_sizes import (ActivationProfile, ModelBytes, largest_activation_profile, load_bytes,
                           low_precision_dtype, model_bytes, shared_out)
from ..optim import optimizer_state_bytes

GiB = 2 ** 30


MARGIN = 0.9  # of the free memory, a plan may use (the allocator's fragmentation, the CUDA context's growth)
HOST_RUNTIME = 128 * 2 ** 20  # a CPU run's own allocations beside the model's (the dataset, autograd's records)


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


def plan_for(spec, weights: ModelBytes, profile: ActivationProfile, checkpointing: bool, block_swap: int,
             device_type: str, budget: int | None) -> MemoryPlan:
    t = spec.train
    low_precision = t.precision in ("bf16", "fp16")
    n = len(profile.saved)
    swapped = sum(weights.frozen_per_block[:block_swap])
    checkpointed = n if checkpointing else block_swap  # swapped blocks are checkpointed by the swap itself
    # the checkpointed blocks are the first ones (memory_savers checkpoints blocks[swap:], swaps blocks[:swap])
    parts = {
        # the swapped blocks' frozen weights stay in host memory, under DeepSpeed too (memory.host_weights_set_aside)
        "weights": weights.frozen - (swapped if device_type == "cuda" else 0),
        # the swapped block computing, the one before it finishing, and a third held by the caching allocator while
        # the copy queued on the stream is made (this plan was 1.06x what an H200 measured, 6 SD1.5 blocks swapped)
        "swapped blocks": 3 * max(weights.frozen_per_block[:block_swap], default=0) if device_type == "cuda" else 0,
        "trained": weights.trained,
        "gradients": weights.trained // weights.gradient_share,
    }
    # the fp32 masters, the optimizer's state and (at its step) the masters' gradients: this process's share, on
    # the device or, offloaded, in host memory
    masters = (4 * weights.trained_count if low_precision else 0) // weights.state_share  # fp32, as their gradients
    state = {"master weights": masters,
             "optimizer": optimizer_state_bytes(t.optimizer) * weights.trained_count // weights.state_share}
    master_gradients = masters
    # pinned host memory: PyTorch's pinned allocator rounds each tensor up to a power of two
    host = {"swapped weights": sum(weights.pinned_per_block[:block_swap])} if device_type == "cuda" else \
        {"runtime": HOST_RUNTIME}
    if weights.weights_offloaded:  # this process's share waits in host memory
        host["offloaded weights"] = parts["weights"]
        parts["weights"] = 0
    # ZeRO 3, its weights offloaded or not: what DeepSpeed keeps gathered at the peak (memory_sizes.gathered)
    if weights.gathered:
        parts["gathered weights"] = weights.gathered
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
            plan.notes.append("memory auto: gradient checkpointing on"
                              + (f", block_swap {plan.block_swap}" if plan.block_swap != d.block_swap else "")
                              + f" (as given the run needs {given.peak / GiB:.2f} GiB)")
            return plan
    return min(tried, key=lambda p: p.peak)


def suggestions(spec, plan: MemoryPlan, weights: ModelBytes, profile: ActivationProfile) -> list[str]:
    """What would bring the run within the plan's budget, cheapest in speed first: checkpointing where it alone
    fits, else the fewest swapped blocks that do (the plain engine on a GPU), then what the plan cannot size
    (an fp8 base, a smaller batch, a lower resolution)."""
    checkpointing_fits = bool(profile.saved) and plan_for(spec, weights, profile, True, spec.distributed.block_swap,
                                                          plan.device, plan.budget).fits()
    what = [s for s in memory_suggestions(spec)
            if "block_swap" not in s and ("gradient_checkpointing" not in s or checkpointing_fits)]
    if plan.device == "cuda" and swap_allowed(spec) and not checkpointing_fits:
        more = [k for k in range(1, len(profile.saved) + 1)
                if plan_for(spec, weights, profile, True, k, plan.device, plan.budget).fits()]
        if more:
            what.insert(0, f"set gradient_checkpointing on and block_swap to {more[0]} or more")
    d = spec.distributed
    if plan.device == "cuda" and d.zero_stage == 3 and not d.offload_params:
        what.append("set offload_params on (DeepSpeed Settings: each process's share of the weights in CPU memory)")
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
    from ..os_support import available_memory
    available = available_memory()
    return None if available is None else int(available * MARGIN) + held


def device_capacity(device) -> int | None:
    """All the memory the device has (the card's total; on a CPU, the machine's RAM): what no setting elsewhere
    can free more of."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    from ..os_support import total_memory
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


def plan_memory(spec, family, dataset, device, data_parallel: int, log) -> MemoryPlan:
    """The run's memory plan, with "auto"'s choice of checkpointing and block swap; refuses (MemoryPlanRefused)
    an "auto" run nothing fits and any run beyond all the device's memory, and warns of a "manual" one that may not
    fit what is free. `log(level, message)` reports "auto"'s choices and the warnings to the node; the plan itself
    goes out in the started event (as_event)."""
    blocks = _blocks(family)
    # a resume of an "auto" run keeps what it began with ("manual": the settings as given, as always)
    began_with = earlier_choice(spec, len(blocks)) if spec.train.resume and spec.train.memory == "auto" else None
    if began_with is not None:  # a resume keeps the settings the run began with: its numbers stay the run's own
        checkpointing, block_swap = began_with
        log("info", f"memory: the settings this run began with (gradient checkpointing "
                    f"{'on' if checkpointing else 'off'}, block_swap {block_swap})")
        spec = dataclasses.replace(
            spec, train=dataclasses.replace(spec.train, gradient_checkpointing=checkpointing, memory="manual"),
            distributed=dataclasses.replace(spec.distributed, block_swap=block_swap))
    t = spec.train
    weights, profile, budget, capacity = _measured(spec, family, blocks, dataset, device, data_parallel, log)
    plan = choose(spec, weights, profile, device.type, budget)
    for note in plan.notes:
        log("info", note)
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


def _blocks(family) -> list:
    try:
        return family.checkpoint_blocks()
    except ValueError:  # a model the generic family finds no block list in: nothing to checkpoint or swap
        return []


def _measured(spec, family, blocks, dataset, device, data_parallel: int, log):
    """(this process's share of the weights, the activation profile, the budget, the device's capacity), each
    process deciding alike (one refusing while the others wait in a collective would hang the run)."""
    t, d = spec.train, spec.distributed
    compute_dtype = low_precision_dtype(t.precision)
    weights = model_bytes(family.diffusion_model, blocks, compute_dtype)
    try:
        with torch.random.fork_rng(devices=[]):
            profile = largest_activation_profile(family, dataset, t.batch_size, blocks, compute_dtype, device)
    except Exception as e:  # a model whose forward the meta device cannot run: plan the weights alone
        log("warning", f"memory plan: activations not measured ({type(e).__name__}: {e}); the plan counts "
                       f"weights and optimizer state only")
        profile = ActivationProfile(0, [0] * len(blocks), [0] * len(blocks), measured=False)
    weights = shared_out(weights, d.zero_stage, data_parallel, d.pipeline_stages, d.offload_optimizer,
                         d.offload_params)
    budget = device_budget(spec, device, weights.frozen if device.type == "cpu" else 0)
    budget = global_min(math.inf if budget is None else budget, device)
    capacity = device_capacity(device)
    return (weights, profile, None if math.isinf(budget) else int(budget),
            None if capacity is None else int(global_min(capacity, device)))


def plan_distillation(spec, generator, dataset, device, data_parallel: int, fakes: int, log) -> MemoryPlan:
    """DMD2's plan (trainer/tasks/distill.py), before its fake scores and teacher load: the generator's with the settings
    as given (no "auto" choice), plus `fakes` fake scores (whole copies with the adapter's training state), the
    frozen teacher, and with the GAN term a fake score's activations (the generator's loss runs back through it).
    Refused beyond all the device's memory (MemoryPlanRefused); a warning beyond the budget."""
    t, blocks = spec.train, _blocks(generator)
    weights, profile, budget, capacity = _measured(spec, generator, blocks, dataset, device, data_parallel, log)
    plan = plan_for(spec, weights, profile, t.gradient_checkpointing, 0, device.type, budget)
    trained_state = sum(plan.parts.get(k, 0) for k in ("trained", "gradients", "master weights", "optimizer"))
    plan.parts["fake scores"] = fakes * (weights.frozen + trained_state)
    plan.parts["teacher"] = weights.frozen + (weights.trained if spec.adapter.kind == "full" else 0)
    if "offloaded optimizer" in plan.host_parts:  # each fake score's optimizer is offloaded as the student's
        plan.host_parts["fake scores' offloaded optimizer"] = fakes * plan.host_parts["offloaded optimizer"]
    if spec.distill.gan_weight > 0:  # whichever peak plan_for chose, the generator's backward holds these too
        held = len(profile.saved) if t.gradient_checkpointing else 0
        plan.parts["fake score activations (GAN)"] = profile.held(held) + profile.recomputed(held)
    what = [s for s in memory_suggestions(spec) if "block_swap" not in s]
    if device.type == "cuda" and spec.distributed.zero_stage != 3:
        what.append("spread the networks over several GPUs with distributed.zero_stage 3")
    need = f"the distillation ({fakes} fake score{'s' if fakes > 1 else ''} and the teacher beside the student) " \
           f"needs {_need(plan)}"
    if capacity is not None and plan.peak > capacity:
        raise MemoryPlanRefused(f"not enough memory: {need} and this {'GPU' if device.type == 'cuda' else 'machine'} "
                                f"has {capacity / GiB:.1f} GiB in all: " + "; or ".join(what)
                                + ". Nothing was moved to the device.")
    if not plan.fits():
        log("warning", f"the memory plan predicts that {need}, and {_allowed(spec, plan)}: " + "; or ".join(what)
            + ". The run starts anyway and may run out of memory.")
    return plan


def earlier_choice(spec, blocks: int) -> tuple[bool, int] | None:
    """(gradient checkpointing, block swap) as the run began, from its signed record; None without one (a run
    from before the plan, or a record this installation did not sign)."""
    from ..run.layout import MEMORY_CHOICE_FILE
    from ..run.trust import TrustError, read_signed_json
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
    from ..run.layout import MEMORY_CHOICE_FILE
    from ..run.trust import write_signed_json
    if rank() == 0:
        write_signed_json(Path(spec.run_dir) / MEMORY_CHOICE_FILE,
                          {"run": Path(spec.run_dir).name, "gradient_checkpointing": plan.checkpointing,
                           "block_swap": plan.block_swap})


def refuse_unloadable(model, precision: str, full: bool = False, partitioned: bool = False,
                      whole_because: str | None = None) -> None:
    """Before a load (a training run's, the evaluate task's): MemoryPlanRefused where this machine's RAM cannot
    hold the model once for every process of the run on it (host_refusal); `partitioned` (ZeRO-3's partitioned
    load): each process holds its share, so the machine's processes hold their part of one copy; `whole_because`:
    why a partitioned load turned out to need whole copies after all (said in the refusal). A model loaded ahead
    of the run (a standby's preload) is no more to load where it is this run's, and is let go first where not."""
    from .distributed import processes_per_machine, world_size
    from ..models import drop_preloaded, preload_is_for
    if partitioned:
        drop_preloaded()  # (a partitioned load reads its shares from the file)
    elif preload_is_for(model, precision):  # loaded already, ahead of the run: nothing more to hold
        return
    refused = host_refusal(model, precision, full=full, processes=processes_per_machine(),
                           share=1 / world_size() if partitioned else 1.0)
    if refused:
        raise MemoryPlanRefused(refused if whole_because is None else
                                f"ZeRO-3 loads each process's share of the weights, but this model loads whole "
                                f"({whole_because}): {refused}")


def host_refusal(model, precision: str, full: bool = False, processes: int = 1, share: float = 1.0) -> str | None:
    """Before the load: the reason the model cannot be loaded into this machine's RAM by the `processes` of the
    run on it (each loads its own copy, or its `share` of one), naming the file and the numbers; None where it
    fits, or where the system or the file's header tells nothing. `full`: a full fine-tune (which cannot take an
    fp8 base)."""
    from ..os_support import available_memory
    if not getattr(model, "path", ""):  # no file to size (ComfyUI's loader says what is missing)
        return None
    available = available_memory()
    one = load_bytes(model, precision)
    if available is None or one is None:
        return None
    one = int(one * share)
    needed = one * processes
    if needed <= available * MARGIN:
        return None
    each = f" ({processes} processes on this machine, {one / GiB:.1f} GiB each)" if processes > 1 else ""
    fp8 = "" if (full or model.weight_dtype.startswith("fp8") or model.base_precision == "fp8") else \
        "set base_precision to fp8 (half the bytes of bf16), or "
    return (f"not enough memory: loading {model.path} needs {needed / GiB:.1f} GiB of RAM{each} and "
            f"{available / GiB:.1f} GiB is available: {fp8}close other programs. Nothing was loaded.")
