"""Trading compute for memory: gradient checkpointing and block swap, applied to the family's blocks; and what
loading the model costs in host memory."""
from __future__ import annotations

import contextlib

import torch


from ..os_support import host_memory, restart_memory_peak


@contextlib.contextmanager
def load_peak(report: dict):
    """Measures the host memory a load needs above what the process held before it: fills `report` with
    rss_before (VmRSS when the load starts) and peak (VmHWM when it ends, the kernel's high-water mark, restarted
    at the start where Linux allows). With the restart refused, the peak is the whole process's so far, which can
    only overstate the load's (always so on Windows, whose peak working set cannot be restarted). Empty where the
    system tells neither (os_support.host_memory)."""
    restart_memory_peak()  # after the imports
    before = host_memory()[0]
    yield report
    peak = host_memory()[1]
    if before is not None and peak is not None:
        report.update(rss_before=before, peak=peak)


def enable_gradient_checkpointing(blocks):
    for block in blocks:
        forward = block.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)
        block.forward = checkpointed


class _CastAgain:
    """What a saved cast copy of a frozen low-precision weight (or a view of it, such as the transpose a matmul
    saves) is replaced by: the layer, cast again in backward, and the view's place in that copy."""
    __slots__ = ("layer", "dtype", "device", "size", "stride", "offset")

    def __init__(self, layer, saved: torch.Tensor):
        self.layer, self.dtype, self.device = layer, saved.dtype, saved.device
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()

    def tensor(self) -> torch.Tensor:
        from ..comfy_compat import cast_weight
        weight = cast_weight(self.layer, self.dtype, self.device).contiguous()
        return weight.as_strided(self.size, self.stride, self.offset)


_WEIGHTED_OPS = {torch.nn.functional.linear, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
                 torch.nn.functional.conv3d}


class WeightArguments(torch.overrides.TorchFunctionMode):
    """Notes the storage of each weight a layer's forward hands to a matmul or convolution: what autograd saves
    from that storage is the weight's cast copy, and nothing else a layer saves (a norm's statistics of the same
    size, say) can be taken for it. `key`: how a storage is named (its address; the memory plan's meta tensors
    have none); `frozen_only`: trained weights are left out."""

    def __init__(self, storages: set, key=lambda t: t.untyped_storage().data_ptr(), frozen_only: bool = True):
        super().__init__()
        self.storages, self.key, self.frozen_only = storages, key, frozen_only

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WEIGHTED_OPS:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if isinstance(weight, torch.Tensor) and not (self.frozen_only and weight.requires_grad):
                self.storages.add(self.key(weight))
        return func(*args, **kwargs)


def pack_for_backward(layer, storages: set, saved: torch.Tensor):
    """A frozen fp8 layer's saved tensor: its weight's cast copy becomes a _CastAgain, anything else stays. The
    first copy of each layer is checked against the cast done again (the same values, or the layer keeps its
    copies: a scaled weight, a path this does not know)."""
    if saved.untyped_storage().data_ptr() not in storages or saved.requires_grad:
        return saved
    again = _CastAgain(layer, saved)
    checked = getattr(layer, "_ingraph_cast_again_checked", None)
    if checked is None:
        with torch.no_grad():
            checked = torch.equal(again.tensor(), saved)
        layer._ingraph_cast_again_checked = checked
    return again if checked else saved


def keep_fp8_weights_for_backward(model: torch.nn.Module, skip=()) -> int:
    """A frozen fp8 layer computes with a full-precision copy of its weight (ComfyUI's cast), and autograd keeps
    that copy for the backward pass: an fp8 base then held more device memory than a bf16 one (measured on an H200,
    issue 30). In these layers the saved copy is dropped and the weight cast again when the backward pass needs
    it: an fp8 base's saved bytes are at most a bf16 base's. Layers under `skip` (blocks whose forward is
    checkpointed: checkpointing saves nothing of theirs) are left alone, since saved-tensor hooks do not nest, and
    so are layers ComfyUI 0.33 places with dynamic VRAM (their cast follows its own prefetching). Returns the
    number of layers changed."""
    from ..adapters import FP8_DTYPES
    from ..comfy_compat import is_quantized
    skipped = {id(m) for block in skip for m in block.modules()}
    changed = 0
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if (id(layer) in skipped or not isinstance(weight, torch.nn.Parameter) or weight.requires_grad
                or weight.dtype not in FP8_DTYPES or is_quantized(weight) or not hasattr(layer, "weight_function")
                or hasattr(layer, "_v") or getattr(layer, "_ingraph_casts_again", False)):
            continue
        forward = layer.forward

        def casts_again(*args, _forward=forward, _layer=layer, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            storages = set()
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: pack_for_backward(_layer, storages, t),
                    lambda saved: saved.tensor() if isinstance(saved, _CastAgain) else saved), \
                    WeightArguments(storages):
                return _forward(*args, **kwargs)
        layer.forward = casts_again
        layer._ingraph_casts_again = True
        changed += 1
    return changed


class BlockCopies:
    """The swapped blocks' frozen weights on their way to the device (copy-in only: frozen weights never travel
    back). By default each block's copy is queued on the compute stream when the block runs, from pinned host
    memory without a host wait: on an H200 (bench/block_swap.py, 8 of 16 blocks of a 400M SDXL-family UNet at
    1024 px) that took 104.6 ms a step against 128.4 ms for the copy ahead below, at 3 % less peak memory.

    `ahead` (the bench's comparison): the next block's copy runs on a side stream while the device computes this
    one (musubi-tuner's swap); the compute stream waits for a copy's event before it uses it, and the host waits
    before each copy ahead until the block before the previous one is computed (bound), so at most three blocks'
    copies are on the device however far ahead of the device the host runs. The next block is the one after in
    the forward pass, the one before while the backward pass recomputes them in reverse. reset() after each step
    drops a copy made ahead for no one. On a CPU each copy is made when its block runs (nothing to overlap)."""

    def __init__(self, hosts: list[dict], device, ahead: bool = False):
        self.hosts, self.device = hosts, torch.device(device)
        self.side = torch.cuda.Stream(self.device) if ahead and self.device.type == "cuda" else None
        self.pending = {}  # block index -> (its weights on the device, what says they have arrived)
        self.mark = None  # the compute stream's progress when the previous copy ahead was made

    def take(self, i: int) -> dict:
        """Block i's weights on the device, ready for the compute stream; starts the next block's copy."""
        backward = getattr(torch._C, "_current_graph_task_id", lambda: -1)() != -1
        ahead = i - 1 if backward else i + 1  # the backward pass recomputes the blocks in reverse
        found = self.pending.pop(i, None)
        weights = self.arrived(*found) if found is not None else self.copy_now(i)
        if self.side is not None and 0 <= ahead < len(self.hosts) and ahead not in self.pending:
            self.bound()
            self.pending[ahead] = self.copy_ahead(ahead)
        return weights

    def bound(self) -> None:
        """Waits until the compute stream has finished what it had been given when the previous copy ahead was
        made (the block before the previous one): the caching allocator reuses a copy's memory only once the
        stream that used it is past it (record_stream), so without this wait every copy ahead took new memory."""
        mark = torch.cuda.Event()
        mark.record(torch.cuda.current_stream(self.device))
        if self.mark is not None:
            self.mark.synchronize()
        self.mark = mark

    def reset(self) -> None:
        self.pending.clear()
        self.mark = None

    def copy_now(self, i: int) -> dict:
        return {name: t.to(self.device, non_blocking=True) for name, t in self.hosts[i].items()}

    def copy_ahead(self, i: int):
        with torch.cuda.stream(self.side):
            weights = self.copy_now(i)
            event = torch.cuda.Event()
            event.record(self.side)
        return weights, event

    def arrived(self, weights: dict, event) -> dict:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for t in weights.values():
            t.record_stream(stream)  # the allocator keeps the copy until the compute stream is done with it
        return weights


def enable_block_swap(blocks, device, dtype=None, copies=BlockCopies) -> BlockCopies:
    """diffusion-pipe's block swap for adapter training: these blocks' frozen weights live in CPU memory and
    visit the device only while the block runs, in the forward pass and again when the backward pass
    recomputes it (swapped blocks are checkpointed, so no copy outlives its block's use); BlockCopies brings them
    in. Trainable adapter weights stay on the device, where the optimizer holds them.
    `dtype`: the training precision, given where the engine casts the model after this (plain_engine), which
    leaves these weights alone."""
    import threading
    from .plain_engine import LOW_PRECISION_CASTABLE
    state = threading.local()
    pinned = torch.cuda.is_available()
    hosts = []
    for block in blocks:
        frozen = {name: p for name, p in block.named_parameters() if not p.requires_grad}
        if dtype is not None:  # the precision the engine gives every other weight (fp8 and integers stay as they are)
            for p in frozen.values():
                if p.dtype in LOW_PRECISION_CASTABLE and p.dtype != dtype:
                    p.data = p.data.to(dtype)
        host = {name: (p.detach().cpu().pin_memory() if pinned else p.detach().cpu()) for name, p in frozen.items()}
        for name, p in frozen.items():
            p.data = host[name]  # the device copy, if any, is freed
            p.host_resident = True  # plain_engine leaves it here: the model never has to fit the card whole
        hosts.append(host)
    arriving = copies(hosts, device)
    for i, block in enumerate(blocks):
        forward = block.forward

        def run_on_device(*args, _block=block, _i=i, **kwargs):
            state.inside = True
            try:
                return torch.func.functional_call(_block, arriving.take(_i), args, kwargs, strict=False)
            finally:
                state.inside = False

        def swapped(*args, _forward=forward, _run=run_on_device, **kwargs):
            if getattr(state, "inside", False):  # functional_call calls the block: run its real forward
                return _forward(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(_run, *args, use_reentrant=False, **kwargs)
        block.forward = swapped
    return arriving


@contextlib.contextmanager
def host_weights_set_aside(module: torch.nn.Module):
    """Block swap's host-resident weights (enable_block_swap) out of the module for the duration: DeepSpeed's engine
    moves its whole module to the device, and casts it, when it starts (engine.py, `module.to(device)`), which a
    model larger than the card would not survive. Those weights are frozen, the same on every process (read from
    the same file), and already in the training precision, so the engine has nothing to do with them."""
    aside = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
             if p is not None and getattr(p, "host_resident", False)]
    for m, name, _ in aside:
        m._parameters[name] = None  # Module._apply and parameters() skip a None entry
    try:
        yield
    finally:
        for m, name, p in aside:
            m._parameters[name] = p


def check_swapped_weights_agree(blocks) -> None:
    """Every process holds the same swapped weights: the engine's start no longer broadcasts them from rank 0
    (host_weights_set_aside), so a rank that read another file (a machine of a hostfile with a different copy at the
    same path) would train on other weights without a word. Compared across ranks: the float64 sum of 65536 evenly
    spaced values of each weight (no whole-size copy of a large weight)."""
    from .distributed import world_size
    if world_size() == 1 or not torch.distributed.is_initialized() or not blocks:
        return
    sums = [float(w.reshape(-1)[::max(1, w.numel() // 65536)].double().sum())
            for block in blocks for w in (p.detach() for p in block.parameters() if getattr(p, "host_resident", False))]
    every = [None] * world_size()
    torch.distributed.all_gather_object(every, sums)
    differing = [rank for rank, other in enumerate(every) if other != every[0]]
    if differing:
        raise RuntimeError(f"model.path: the swapped blocks' weights differ between rank 0 and rank(s) {differing}: "
                           "every machine must have the same model file at the same path")


def memory_savers(family, checkpointing: bool, block_swap: int) -> list:
    """Checkpoints the blocks asked for (the memory plan's choice, memory_plan.plan_memory); returns the blocks to
    swap (enable_block_swap: before the plain engine moves the model to the device, which leaves them in host
    memory; after DeepSpeed's engine, which moves everything; swapped blocks are checkpointed by the swap
    itself). The memory plan assumes this order: the first `block_swap` blocks swapped, the rest checkpointed."""
    blocks = family.checkpoint_blocks() if (checkpointing or block_swap) else []
    if block_swap > len(blocks):
        raise ValueError(f"distributed.block_swap: this model has {len(blocks)} blocks (got {block_swap})")
    if checkpointing:
        enable_gradient_checkpointing(blocks[block_swap:])
    keep_fp8_weights_for_backward(family.diffusion_model, skip=blocks)
    return blocks[:block_swap]


def checkpointed_with_fp8_kept(family, checkpointing: bool) -> None:
    """A network of a distillation run: its blocks checkpointed where asked, and its fp8 layers outside them
    cast again for the backward pass (keep_fp8_weights_for_backward)."""
    blocks = family.checkpoint_blocks() if checkpointing else []
    enable_gradient_checkpointing(blocks)
    keep_fp8_weights_for_backward(family.diffusion_model, skip=blocks)


def swap_allowed(spec) -> bool:
    """Where block swap may be suggested or chosen: where the spec's one block-swap rule finds no conflict."""
    return not spec.block_swap_conflicts()


def memory_suggestions(spec) -> list[str]:
    """What would lower a run's device memory, cheapest in speed first, among the settings it does not use yet."""
    t, a, d, m = spec.train, spec.adapter, spec.distributed, spec.model
    found = []
    if not t.gradient_checkpointing:
        found.append("turn on gradient_checkpointing")
    if a.kind not in ("full", "dora") and m.base_precision != "fp8" and "fp8" not in (m.weight_dtype or ""):
        found.append("set base_precision to fp8")
    if swap_allowed(spec) and not d.block_swap:
        found.append("set block_swap (DeepSpeed Settings) to some of the model's blocks")
    if t.batch_size > 1:
        found.append(f"lower batch_size to {t.batch_size // 2} and raise gradient_accumulation to "
                     f"{t.grad_accum * 2} (the same batch)")
    found.append("train at a lower resolution")
    return found


def out_of_memory_message(spec, step: int) -> str:
    """"out of GPU memory at step N (peak X GiB of Y GiB): <what would fit>; ..." for the run's error event."""
    from ..device import device_memory, local_cuda_index
    index = local_cuda_index()
    memory = None
    if index is not None:
        import torch
        memory = device_memory(torch.device("cuda", index))
    where = f"at step {step}" if step else "while loading the model"
    peak = (f" (peak {memory['peak_allocated'] / 2**30:.1f} GiB of {memory['total'] / 2**30:.1f} GiB)"
            if memory else "")
    return (f"out of GPU memory {where}{peak}: " + "; or ".join(memory_suggestions(spec)) +
            ". The last complete checkpoint is intact.")
