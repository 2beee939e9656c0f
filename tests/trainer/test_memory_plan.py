"""Issue 30's memory plan: the activations it measures on the meta device are what autograd really saves, "auto"
turns on checkpointing where the run would not fit its budget (and its measured peak then fits), a run that
nothing fits is refused before its first step naming the numbers, and "manual" warns and runs."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from conftest import REPO, read_events, run_trainer

pytestmark = pytest.mark.comfyui

ONE_QUANTILE = dict(train__eval_quantiles=[0.5], train__eval_items=1)
GiB = 2 ** 30


def saved_tensor_counter(model, block=lambda: None):
    """(pack, saved): a saved_tensors_hooks pack function noting each storage autograd saves once, the model's weights
    apart, in `saved` as storage -> (bytes, block() when first saved). Every tensor noted is kept alive, so no storage
    is freed and its address reused by another meanwhile."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, kept = {}, []

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights and key not in saved:
            saved[key] = (t.untyped_storage().nbytes(), block())
            kept.append(t)
        return t
    return pack, saved


@pytest.mark.parametrize("latent_hw,attention,kind", [((16, 16), "this machine's", "lora"),
                                                     ((24, 16), "this machine's", "lora"),
                                                     ((16, 16), "pytorch", "lora"),
                                                     ((16, 16), "this machine's", "lokr"),
                                                     ((16, 16), "this machine's", "loha"),
                                                     ((16, 16), "this machine's", "lokr, peft's own path"),
                                                     ((16, 16), "this machine's", "dora")])
def test_the_meta_pass_counts_exactly_what_a_real_forward_saves(tiny_unet, latent_hw, attention, kind,
                                                                monkeypatch):
    """The plan's activations come from a forward pass on the meta device (no memory). The same pass on real
    tensors, with an adapter, saves those bytes for backward (weights apart), block by block. "pytorch": ComfyUI's
    attention on NVIDIA cards (scaled_dot_product_attention), whose meta version saves the whole attention matrix
    where the real fused kernel saves a statistic per row (2.5 GiB too many for SD1.5 at 512 px). LoKr and LoHa
    compute each layer's whole weight change and hand it to the matmul, which saves it: a weight's size per adapted
    layer (for SDXL about the base's bytes again), not a parameter; the trainer makes it again in the backward pass
    instead, except under ZeRO-3, where peft's path keeps it and the plan counts it (it did not: SDXL LoKr's
    measured peak was twice the plan's)."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    if attention == "pytorch":
        import comfy.ldm.modules.attention as comfy_attention
        monkeypatch.setattr(comfy_attention, "optimized_attention", comfy_attention.attention_pytorch)
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.parallel.memory_sizes import activation_profile
    from ingraph_trainer.trainer.models import Batch, load_family
    family = load_family(ModelSpec(path=str(tiny_unet)), precision="bf16")
    torch.manual_seed(0)
    kind, zero_stage = ("lokr", 3) if kind == "lokr, peft's own path" else (kind, 0)
    inject_adapter(family.diffusion_model, family.adapter_targets("attention_ff"), kind, 4, 4.0, 0.0, zero_stage)
    family.prepare_for_training()
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, *latent_hw, generator=g)
    batch = Batch(latents, torch.randn(2, 77, 768, generator=g), None, torch.randn(latents.shape, generator=g),
                  torch.tensor([0.3, 0.7]))
    with torch.no_grad():
        inputs = family.model_inputs(batch)
    blocks = family.checkpoint_blocks()
    profile = activation_profile(family, inputs, blocks, torch.bfloat16, torch.device("cpu"))

    current = [None]
    index = {id(b): i for i, b in enumerate(blocks)}
    hooks = [b.register_forward_pre_hook(lambda m, a: current.__setitem__(0, index[id(m)])) for b in blocks]
    hooks += [b.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)) for b in blocks]
    count, saved = saved_tensor_counter(family.diffusion_model, lambda: current[0])
    x, timestep, kwargs = inputs
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        family.diffusion_model(x.to(torch.bfloat16), timestep, transformer_options={}, **kwargs)
    for hook in hooks:
        hook.remove()
    per_block = [sum(size for size, b in saved.values() if b == i) for i in range(len(blocks))]
    outside = sum(size for size, b in saved.values() if b is None)
    assert sum(per_block) > 0 and len(blocks) > 4  # the precondition: blocks that save something
    # the same tensors; a layer norm's fp32 statistics are the one difference seen: ATen's CPU kernel gives them
    # a storage of half the size their shape has on the meta device (1 KB against 2 KB per norm)
    assert len(profile.saved) == len(per_block)
    assert all(abs(m - r) <= 0.005 * r + 8192 for m, r in zip(profile.saved, per_block)), (profile.saved, per_block)
    assert abs(profile.outside - outside) <= 0.005 * outside + 8192, (profile.outside, outside)
    assert all(n > 0 for n in profile.inputs)


def test_the_plan_measures_the_longest_caption_where_it_saves_more_than_the_largest_image(tiny_unet, tmp_path,
                                                                                        monkeypatch):
    """Issue 30: the plan measured the largest latent only, whatever its caption. Here a small image with a long
    caption (a text encoder that does not pad) saves more than the largest image with a short one: the plan takes
    both candidates from the text shards' headers and keeps the larger measurement."""
    import hashlib
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from safetensors.torch import save_file
    from ingraph_trainer.cache.shards import entry_path
    from ingraph_trainer.trainer.parallel import memory_sizes
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.models import Batch, load_family

    class Captioned:  # what largest_items reads of a CachedDataset: latent shapes, the cache root, the text keys
        def __init__(self, items):  # [(latent h, w), caption tokens]
            self.root, self.buckets, self.text_keys, self.tokens = tmp_path, [], [], {}
            for n, ((h, w), tokens) in enumerate(items):
                key = hashlib.sha256(f"{items} caption {n}".encode()).hexdigest()  # a shard per caption
                path = entry_path(tmp_path, "text", key)
                path.parent.mkdir(parents=True, exist_ok=True)
                save_file({"cond": torch.zeros(tokens, 768)}, str(path))
                self.buckets.append((4, h, w))
                self.text_keys.append(key)
                self.tokens[n] = tokens

    large_image, long_caption, small = ((16, 16), 77), ((8, 8), 77 * 32), ((8, 8), 77)
    dataset = Captioned([small, large_image, long_caption, small])
    assert memory_sizes.largest_items(dataset) == [1, 2]
    assert memory_sizes.largest_items(Captioned([small, large_image, small])) == [1]  # padded captions: one pass

    family = load_family(ModelSpec(path=str(tiny_unet)), precision="bf16")
    torch.manual_seed(0)
    inject_adapter(family.diffusion_model, family.adapter_targets("attention_ff"), "lora", 4, 4.0, 0.0)  # as planned
    family.prepare_for_training()

    def item_inputs(family, dataset, item, batch_size):  # the item's shapes, as training_batch would give them
        _, h, w = dataset.buckets[item]
        latents = torch.zeros(batch_size, 4, h, w)
        batch = Batch(latents, torch.zeros(batch_size, dataset.tokens[item], 768), None, latents,
                      torch.full((batch_size,), 0.5))
        with torch.no_grad():
            return family.model_inputs(batch)
    monkeypatch.setattr(memory_sizes, "item_inputs", item_inputs)
    blocks = family.checkpoint_blocks()
    measure = lambda item: memory_sizes.activation_profile(  # noqa: E731
        family, item_inputs(family, dataset, item, 2), blocks, torch.bfloat16, torch.device("cpu"))
    caption, image = measure(2), measure(1)
    assert sum(image.saved) > 0  # the precondition: a pass that saves activations (an adapter trains)
    assert caption.held(0) > image.held(0)  # the premise: the long caption saves more than the large image
    planned = memory_sizes.largest_activation_profile(family, dataset, 2, blocks, torch.bfloat16, torch.device("cpu"))
    for k in range(len(blocks) + 1):  # whatever the plan checkpoints, it counts at least what either item needs
        assert planned.held(k) >= max(caption.held(k), image.held(k))
        assert planned.recomputed(k) >= max(caption.recomputed(k), image.recomputed(k))
    assert planned.held(0) > image.held(0)


def _plan_run(prepared, **overrides):
    spec = prepared(train__steps=2, train__precision="fp32", adapter__rank=4, train__batch_size=8, **ONE_QUANTILE,
                    **overrides)
    proc = run_trainer(spec)
    events = read_events(spec.parent)
    return proc, events, spec


def test_auto_checkpoints_to_fit_a_budget_manual_warns_and_nothing_fitting_is_refused(prepared):
    """Three runs of one tiny model on simulated budgets (train.memory_budget_gb):
    - "manual" on a budget far too small: a warning naming the numbers, then the run as given, which finishes;
    - "auto" on a budget just under that plan: gradient checkpointing is turned on (the started event and a log
      line say so), and the run's measured peak above its baseline fits the budget;
    - "auto" on a budget nothing fits: refused before any step, the error naming the need, the budget and what
      would fit."""
    proc, events, _ = _plan_run(prepared, train__memory="manual", train__memory_budget_gb=0.01)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (started,) = [e for e in events if e["type"] == "started"]
    plan = started["memory_plan"]
    assert started["gradient_checkpointing"] is False and plan["gradient_checkpointing"] is False
    warnings = [e["message"] for e in events if e["type"] == "log" and e["level"] == "warning"]
    assert any(m.startswith("the memory plan predicts ") and "0.0 GiB may be used (memory_budget_gb): " in m
               and m.endswith("The run starts anyway (memory 'manual') and may run out of memory.")
               for m in warnings), warnings
    given = plan["host_peak"]
    measured_given = next(e for e in events if e["type"] == "finished")["host_memory"]["rise"]

    budget_gb = (given - 1) / GiB
    proc, events, spec = _plan_run(prepared, train__memory_budget_gb=budget_gb, train__save_every=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (started,) = [e for e in events if e["type"] == "started"]
    assert started["gradient_checkpointing"] is True, started["memory_plan"]
    assert started["memory_plan"]["host_peak"] <= budget_gb * GiB < given
    notes = [e["message"] for e in events if e["type"] == "log"]
    assert any(m.startswith("memory auto: gradient checkpointing on") for m in notes), notes
    measured = next(e for e in events if e["type"] == "finished")["host_memory"]["rise"]
    print(f"\nplan as given {given / 2**20:.1f} MiB (measured {measured_given / 2**20:.1f}); auto with checkpointing "
          f"{started['memory_plan']['host_peak'] / 2**20:.1f} MiB (measured {measured / 2**20:.1f}) on a budget of "
          f"{budget_gb * 1024:.1f} MiB")
    assert measured <= budget_gb * GiB
    assert measured < measured_given - 16 * 2**20  # the choice is real: checkpointing lowered the measured peak
    from safetensors import safe_open
    with safe_open(next(e for e in events if e["type"] == "finished")["adapter"], "pt") as f:
        assert f.metadata()["ss_gradient_checkpointing"] == "True"  # what the run did, not the spec's False
    # a resume keeps the settings the run began with (its record, signed), whatever it would choose now
    resumed = run_trainer(spec, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    later = read_events(spec.parent)[len(events):]
    assert [e for e in later if e["type"] == "started"][0]["gradient_checkpointing"] is True
    assert any(e["type"] == "log" and e["message"].startswith("memory: the settings this run began with (gradient "
                                                               "checkpointing on, block_swap 0)") for e in later)

    proc, events, _ = _plan_run(prepared, train__memory_budget_gb=0.01)
    assert proc.returncode != 0
    assert not [e for e in events if e["type"] in ("started", "step")]
    (error,) = [e for e in events if e["type"] == "error"]
    assert error["message"].startswith("MemoryPlanRefused: not enough memory: with gradient checkpointing on the "
                                       "run needs "), error["message"]
    assert "GiB on the CPU" in error["message"] and "0.0 GiB may be used (memory_budget_gb): " in error["message"]
    assert "turn on gradient_checkpointing" not in error["message"]  # auto already tried it
    assert "Nothing was moved to the device" in error["message"]


def test_on_a_gpu_auto_swaps_the_fewest_blocks_that_fit_and_the_refusal_names_the_count():
    """The decision on a card, from the plan's figures alone (no GPU here): checkpointing first, then the fewest
    swapped blocks that fit; "manual" keeps the settings; a budget nothing fits names the swap that would."""
    from ingraph_trainer.trainer.spec import RunSpec
    from ingraph_trainer.trainer.parallel.memory_plan import choose, refusal, warning
    from ingraph_trainer.trainer.parallel.memory_sizes import ActivationProfile, ModelBytes
    blocks = 10
    weights = ModelBytes(frozen=12 * GiB, frozen_per_block=[1 * GiB] * blocks, trained=GiB // 100,
                         trained_count=GiB // 200, pinned_per_block=[GiB] * blocks)
    profile = ActivationProfile(outside=GiB // 10, saved=[GiB // 2] * blocks, inputs=[GiB // 50] * blocks)
    spec = RunSpec()
    spec.train.precision = "bf16"

    def plan(memory: str, budget_gb: float):
        spec.train.memory = memory
        return choose(spec, weights, profile, "cuda", int(budget_gb * GiB))
    roomy = plan("auto", 40)
    assert (roomy.checkpointing, roomy.block_swap) == (False, 0) and roomy.fits()
    checkpointed = plan("auto", roomy.device_peak / GiB - 0.5)
    assert (checkpointed.checkpointing, checkpointed.block_swap) == (True, 0) and checkpointed.fits()
    swapped = plan("auto", 10)
    assert swapped.checkpointing and swapped.fits()
    assert swapped.block_swap > 0 and not plan_fits_with(spec, weights, profile, swapped.block_swap - 1, 10)
    assert swapped.host_parts["swapped weights"] == swapped.block_swap * GiB
    manual = plan("manual", 10)
    assert (manual.checkpointing, manual.block_swap) == (False, 0) and not manual.fits()
    message = warning(spec, manual, weights, profile)  # "manual"'s warning
    assert message.startswith("the memory plan predicts ") and "GiB on the GPU" in message, message
    assert ("10.0 GiB may be used (90% of the free memory): set gradient_checkpointing on and block_swap to "
            f"{swapped.block_swap} or more; or set base_precision to fp8") in message, message
    hopeless = plan("auto", 0.5)
    assert not hopeless.fits() and "block_swap" not in refusal(spec, hopeless, weights, profile)
    spec.distributed.zero_stage = 1  # DeepSpeed's engine starts without the swapped weights (host_weights_set_aside)
    deepspeed = plan("auto", 10)
    assert (deepspeed.block_swap, deepspeed.parts["weights"]) == (swapped.block_swap, swapped.parts["weights"])
    spec.distributed.zero_stage = 3  # ZeRO-3 partitions the weights itself: no swap to choose, none named
    zero3 = plan("auto", 10)
    assert zero3.block_swap == 0 and not zero3.fits() and zero3.parts["weights"] == 12 * GiB
    assert "block_swap" not in refusal(spec, zero3, weights, profile)
    spec.distributed.zero_stage, spec.train.memory, spec.distributed.block_swap = 1, "manual", 4
    assert plan("manual", 10).parts["weights"] == 8 * GiB  # a swap the user asked for, under DeepSpeed too
    spec.distributed.zero_stage, spec.distributed.block_swap = 0, 0
    spec.adapter.kind = "full"  # block swap is for adapter training: auto never picks it, the refusal never names it
    spec.train.memory = "auto"
    full = choose(spec, weights, profile, "cuda", 10 * GiB)
    assert full.block_swap == 0 and "block_swap" not in refusal(spec, full, weights, profile)


def plan_fits_with(spec, weights, profile, block_swap: int, budget_gb: float) -> bool:
    from ingraph_trainer.trainer.parallel.memory_plan import plan_for
    return plan_for(spec, weights, profile, True, block_swap, "cuda", int(budget_gb * GiB)).fits()


@pytest.mark.parametrize("weight_dtype", ["default", "fp8_e4m3fn"])
def test_the_load_is_sized_from_the_files_header_and_refused_when_ram_cannot_hold_it(tiny_unet, weight_dtype,
                                                                                     monkeypatch):
    """Before the load: the bytes the trainer will hold, read from the safetensors header alone, are the loaded
    model's (bf16 and fp8 bases); with less RAM available than that, the run is refused naming the file."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer import os_support
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.parallel.memory_plan import host_refusal
    from ingraph_trainer.trainer.parallel.memory_sizes import load_bytes
    from ingraph_trainer.trainer.models import load_family
    model = ModelSpec(path=str(tiny_unet), weight_dtype=weight_dtype)
    held = load_family(model, precision="bf16").base_weight_bytes()
    predicted = load_bytes(model, "bf16")
    assert abs(predicted - held) <= 0.02 * held, (predicted, held)
    assert host_refusal(model, "bf16") is None  # this machine has the RAM
    monkeypatch.setattr(os_support, "available_memory", lambda: held // 2)
    message = host_refusal(model, "bf16")
    assert message.startswith(f"not enough memory: loading {tiny_unet} needs ") and "GiB of RAM" in message
    assert ("set base_precision to fp8" in message) == (weight_dtype == "default"), message
    # RAM for one copy and a half: 2 processes on this machine cannot each load their own; with ZeRO-3's partitioned
    # load each holds half of one copy, which fits
    monkeypatch.setattr(os_support, "available_memory", lambda: held * 3 // 2)
    assert host_refusal(model, "bf16", processes=2) is not None
    assert host_refusal(model, "bf16", processes=2, share=0.5) is None


def test_with_block_swap_only_the_plans_resident_weights_reach_the_device(tiny_unet):
    """The plain engine's placement with N blocks swapped, onto a stand-in device (meta: what reaches it is
    counted, nothing allocated): the frozen bytes that arrive are the base minus the swapped blocks, exactly the
    plan's resident weights, and the swapped blocks' weights stay in host memory."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.parallel.memory import enable_block_swap, memory_savers
    from ingraph_trainer.trainer.parallel.memory_sizes import model_bytes
    from ingraph_trainer.trainer.parallel.plain_engine import hold_in
    from ingraph_trainer.trainer.training_module import TrainingModule
    family = load_tiny(tiny_unet)
    inject_adapter(family.diffusion_model, family.adapter_targets("attention"), "lora", 4, 4.0, 0.0)
    blocks = family.checkpoint_blocks()
    swap = len(blocks) // 2
    assert all(p.dtype == torch.bfloat16 for b in blocks for p in b.parameters() if not p.requires_grad)
    planned = model_bytes(family.diffusion_model, blocks, torch.bfloat16)
    swapped_bytes = sum(planned.frozen_per_block[:swap])
    assert 0 < swapped_bytes < planned.frozen  # the precondition: the swap takes some weights, not all
    pinned = [sum(1 << (p.numel() * 2 - 1).bit_length() for p in b.parameters() if not p.requires_grad)
              for b in blocks]  # PyTorch's pinned allocator: each tensor rounded up to a power of two
    assert planned.pinned_per_block == pinned and sum(pinned[:swap]) > swapped_bytes
    swapped = memory_savers(family, False, swap)
    enable_block_swap(swapped, torch.device("meta"), torch.bfloat16)
    module = TrainingModule(family)
    hold_in(module, torch.bfloat16, torch.device("meta"))
    arrived = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
                  if t.device.type == "meta" and not t.requires_grad)
    assert arrived == planned.frozen - swapped_bytes
    kept = [p for block in swapped for p in block.parameters() if not p.requires_grad]
    assert kept and all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in kept)


def load_tiny(path):
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.models import load_family
    return load_family(ModelSpec(path=str(path)), precision="bf16")


def test_a_run_beyond_all_the_devices_memory_is_refused_even_when_manual():
    """Issue 28's last finding: a client may ask for what no machine holds (batch 1024 at 4096 px, rank 1024).
    "manual" only warns where free memory is short; beyond all the device's memory the run is refused."""
    from ingraph_trainer.trainer.spec import RunSpec
    from ingraph_trainer.trainer.parallel.memory_plan import beyond_the_machine, choose
    from ingraph_trainer.trainer.parallel.memory_sizes import ActivationProfile, ModelBytes
    weights = ModelBytes(frozen=2 * GiB, frozen_per_block=[GiB // 5] * 10, trained=GiB // 100,
                         trained_count=GiB // 200)
    profile = ActivationProfile(outside=GiB, saved=[8 * GiB] * 10, inputs=[GiB] * 10)
    spec = RunSpec()
    spec.train.memory = "manual"
    plan = choose(spec, weights, profile, "cuda", 20 * GiB)
    assert not plan.fits() and plan.peak > 24 * GiB
    message = beyond_the_machine(spec, plan, weights, profile, 24 * GiB)
    assert message.startswith("not enough memory: with gradient checkpointing off the run needs ") \
        and "and this GPU has 24.0 GiB in all: " in message, message
    assert beyond_the_machine(spec, plan, weights, profile, plan.peak) is None
    assert beyond_the_machine(spec, plan, weights, profile, None) is None


def test_zero_and_offload_shares_and_a_model_without_blocks():
    """One process's share under ZeRO (1: masters and optimizer state split over the data-parallel processes; 2:
    the gradients too) and with optimizer offload (masters and state in host memory); a model without a block
    list is planned as given, "auto" having nothing to checkpoint or swap."""
    from ingraph_trainer.trainer.spec import RunSpec
    from ingraph_trainer.trainer.parallel.memory_plan import plan_for
    from ingraph_trainer.trainer.parallel.memory_sizes import shared_out
    from ingraph_trainer.trainer.parallel.memory_sizes import ActivationProfile, ModelBytes
    weights = ModelBytes(frozen=0, frozen_per_block=[0] * 4, trained=2 * GiB, trained_count=GiB)  # full, bf16
    profile = ActivationProfile(outside=GiB // 10, saved=[GiB // 10] * 4, inputs=[GiB // 100] * 4)
    spec = RunSpec()
    spec.train.precision = "bf16"

    def plan(zero: int, offload: bool = False):
        return plan_for(spec, shared_out(weights, zero, 4, 1, offload), profile, False, 0, "cuda", None)
    alone = plan(0)
    assert (alone.parts["master weights"], alone.parts["optimizer"], alone.parts["gradients"]) == \
        (4 * GiB, 8 * GiB, 2 * GiB)
    assert alone.parts["master gradients"] == 4 * GiB  # the step's peak (a full fine-tune's)
    zero1, zero2, zero3 = plan(1), plan(2), plan(3)
    assert (zero1.parts["master weights"], zero1.parts["optimizer"], zero1.parts["gradients"]) == \
        (GiB, 2 * GiB, 2 * GiB)
    assert zero2.parts["gradients"] == GiB // 2
    assert (zero3.parts["trained"], zero3.parts["gradients"], zero3.parts["optimizer"]) == (GiB // 2, GiB // 2, 2 * GiB)
    offloaded = plan(2, offload=True)
    assert "optimizer" not in offloaded.parts and "master weights" not in offloaded.parts
    assert offloaded.host_parts["offloaded optimizer"] == GiB + 2 * GiB + GiB
    # ZeRO-3's weight offload: this process's share of the frozen weights in host memory; with or without it, what
    # DeepSpeed keeps gathered at the peak is on the device: up to its 1e9 live parameters (here 4e9 in 8 GiB)
    adapter = ModelBytes(frozen=8 * GiB, frozen_per_block=[GiB, 3 * GiB, 2 * GiB, 2 * GiB], trained=GiB // 8,
                         trained_count=GiB // 16, frozen_count=4 * 10 ** 9)
    kept, offloaded_weights = (plan_for(spec, shared_out(adapter, 3, 4, 1, False, offload_params), profile, False, 0,
                                        "cuda", None) for offload_params in (False, True))
    assert kept.parts["weights"] == 2 * GiB and kept.parts["gathered weights"] == pytest.approx(2 * GiB, rel=0.05)
    assert "offloaded weights" not in kept.host_parts
    assert kept.device_peak - offloaded_weights.device_peak == 2 * GiB  # offload saves exactly the share it moves
    assert offloaded_weights.parts["weights"] == 0 and offloaded_weights.host_parts["offloaded weights"] == 2 * GiB
    # a model under 1e9 parameters ends its forward pass gathered whole
    small = shared_out(dataclasses.replace(adapter, frozen_count=10 ** 8), 3, 4, 1, False)
    assert plan_for(spec, small, profile, False, 0, "cuda", None).parts["gathered weights"] == 8 * GiB + GiB // 8
    # a full fine-tune's trained weights are gathered as well (1.07e9 of them: 1e9 stay gathered)
    assert zero3.parts["gathered weights"] == int(2 * GiB * 10 ** 9 / GiB)
    assert shared_out(adapter, 2, 4, 1, False, True).weights_offloaded is False  # stage 3's alone

    from ingraph_trainer.trainer.parallel.memory_plan import choose
    none = ActivationProfile(outside=GiB, saved=[], inputs=[])
    spec.train.memory = "auto"
    planned = choose(spec, ModelBytes(frozen=GiB, frozen_per_block=[], trained=0, trained_count=0), none, "cuda",
                     GiB // 2)
    assert (planned.checkpointing, planned.block_swap) == (False, 0) and not planned.fits()


def test_block_swap_brings_the_next_block_ahead_in_either_direction_with_the_same_gradients(tiny_unet):
    """The copy-ahead order of block swap (memory.BlockCopies), with its GPU copies recorded instead (no GPU
    here): the forward pass takes blocks 0, 1, 2 and brings each next one ahead, the backward pass recomputes them
    in reverse and brings the one before ahead; every copy made ahead is used, none is left over, and the
    adapter's gradients are those of the same model without the swap."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.parallel.memory import BlockCopies, enable_block_swap, memory_savers
    from ingraph_trainer.trainer.models import Batch

    class Recorded(BlockCopies):
        def __init__(self, hosts, device):
            super().__init__(hosts, device, ahead=True)
            self.side, self.log = "recorded", []  # a side stream stand-in: copies ahead are made

        def copy_ahead(self, i):
            self.log.append(("ahead", i))
            return self.copy_now(i), None

        def arrived(self, weights, event):
            return weights

        def bound(self):
            self.log.append(("bound",))

        def take(self, i):
            self.log.append(("take", i, i in self.pending))
            return super().take(i)

    def gradients(swap: int):
        family = load_tiny(tiny_unet)
        family.compute_dtype = torch.float32
        torch.manual_seed(0)
        params = inject_adapter(family.diffusion_model, family.adapter_targets("attention"), "lora", 4, 4.0, 0.0)
        for p in params:
            torch.nn.init.normal_(p, std=0.05)
        family.diffusion_model.float()
        copies = enable_block_swap(memory_savers(family, False, swap), torch.device("cpu"), copies=Recorded) \
            if swap else None
        g = torch.Generator().manual_seed(1)
        latents = torch.randn(2, 4, 16, 16, generator=g)
        batch = Batch(latents, torch.randn(2, 77, 768, generator=g), None, torch.randn(latents.shape, generator=g),
                      torch.tensor([0.3, 0.7]))
        family.loss(batch).backward()
        return [p.grad.clone() for p in params], copies
    plain, _ = gradients(0)
    swapped, copies = gradients(5)
    takes = [(entry[1], entry[2]) for entry in copies.log if entry[0] == "take"]
    aheads = [entry[1] for entry in copies.log if entry[0] == "ahead"]
    # the forward pass, then the backward pass's recomputation down to block 2, the first with an adapter (blocks
    # 0 and 1 need no gradient: nothing before them trains)
    assert [i for i, _ in takes] == [0, 1, 2, 3, 4, 4, 3, 2], copies.log
    assert aheads == [1, 2, 3, 4, 3, 2, 1], copies.log
    assert [ready for _, ready in takes] == [False, True, True, True, True, False, True, True], copies.log
    assert list(copies.pending) == [1]  # brought ahead for no one: the loop's reset() after the step drops it
    assert sum(1 for entry in copies.log if entry[0] == "bound") == len(aheads)  # each copy ahead waits its turn
    copies.reset()
    assert copies.pending == {} and copies.mark is None
    assert len(plain) == len(swapped) > 0 and all(torch.equal(a, b) for a, b in zip(plain, swapped))
    # the trainer's copies on a GPU are queued on the compute stream: faster than copying ahead on an H200
    assert BlockCopies([], torch.device("cuda")).side is None


def test_the_plan_table_builds_real_architectures_on_the_meta_device():
    """tools/plan_memory_table.py (the README's planned figures): the full SD1.5 UNet built by ComfyUI's classes on
    the meta device holds its 859.5M weights in bf16, checkpointing lowers the planned peak, and "auto" on cards
    from roomy to small keeps the settings, turns checkpointing on, then swaps blocks, each where the plan says."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from tools.plan_memory_table import plans
    cards = [1.5, 2.5, 2.65, 3.0, 8.0]  # SD1.5 at 256 px plans 1.96 GiB as given, 1.78 checkpointed
    rows = plans("SD1.5", 256, False, cards)
    by_setting = {r["setting"]: r for r in rows}
    off, on = by_setting["checkpointing off"], by_setting["checkpointing on"]
    assert off["parts"]["weights"] == 859_520_964 * 2, off["parts"]
    assert on["peak"] < off["peak"]
    chosen = []
    for card in cards:  # "auto": as given where it fits, else checkpointing, else blocks swapped, else refused
        budget, choice = (card * 0.9 - 0.5) * GiB, by_setting[f"auto on a {card:g} GB card"]["choice"]
        expected = "checkpointing off" if off["peak"] <= budget else "checkpointing on" if on["peak"] <= budget \
            else None
        assert choice == expected if expected else ("blocks swapped" in choice or choice == "refused"), (card, choice)
        chosen.append(choice)
    assert {"checkpointing off", "checkpointing on"} <= set(chosen) and any("swapped" in c for c in chosen), chosen


def test_a_resume_reads_the_settings_its_run_began_with_only_from_its_own_signed_record(tmp_path, monkeypatch):
    """The record "auto"'s choice is kept in (memory_choice.json, under output/ where any client writes): read
    back as written; refused when altered, when another run's, or when it names more blocks than the model has."""
    import json
    from ingraph_trainer.trainer.spec import RunSpec
    from ingraph_trainer.trainer.run.layout import MEMORY_CHOICE_FILE
    from ingraph_trainer.trainer.parallel.memory_plan import MemoryPlan, earlier_choice, record_choice
    monkeypatch.setenv("INGRAPH_SECRET_FILE", str(tmp_path / "secret"))
    spec = RunSpec()
    spec.run_dir = str(tmp_path / "run_a")
    (tmp_path / "run_a").mkdir()
    record_choice(spec, MemoryPlan("cuda", True, 3, {}, {}, None))
    assert earlier_choice(spec, 10) == (True, 3)
    assert earlier_choice(spec, 2) is None  # more blocks than this model has
    path = tmp_path / "run_a" / MEMORY_CHOICE_FILE
    data = json.loads(path.read_text())
    path.write_text(json.dumps(dict(data, block_swap=0)))
    assert earlier_choice(spec, 10) is None  # altered: the signature no longer holds
    other = RunSpec()
    other.run_dir = str(tmp_path / "run_b")
    (tmp_path / "run_b").mkdir()
    record_choice(other, MemoryPlan("cuda", False, 1, {}, {}, None))
    path.write_bytes((tmp_path / "run_b" / MEMORY_CHOICE_FILE).read_bytes())
    assert earlier_choice(spec, 10) is None  # another run's record


@pytest.mark.parametrize("kind,checkpointed,targets", [("lokr", False, "attention_ff"), ("loha", False, "attention_ff"),
                                                      ("lokr", True, "attention_ff"), ("lokr", False, "all_layers"),
                                                      ("loha", False, "all_layers")])
def test_loha_and_lokr_make_their_weight_change_again_in_backward_with_the_same_gradients(tiny_unet, kind,
                                                                                          checkpointed, targets):
    """peft's LoHa and LoKr hand each layer's whole weight change to the matmul, which saves it for the backward
    pass (a weight's bytes per adapted layer); the trainer makes it again there instead (trainer/recomputed_delta.py),
    except under ZeRO-3. The same loss and gradients, and the saved bytes fall by at least the changes' size; with
    the blocks checkpointed (as gradient checkpointing and block swap run them) the same gradients; "all_layers":
    the convolutions too."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.models import Batch, load_family
    from ingraph_trainer.trainer.spec import ModelSpec
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 16, 16, generator=g)
    batch = Batch(latents, torch.randn(2, 77, 768, generator=g), None, torch.randn(latents.shape, generator=g),
                  torch.tensor([0.3, 0.7]))

    def step(zero_stage: int):
        family = load_family(ModelSpec(path=str(tiny_unet)), precision="bf16")
        names = family.adapter_targets(targets, kind)
        params = inject_adapter(family.diffusion_model, names, kind, 4, 4.0, 0.0, zero_stage)
        family.prepare_for_training()
        if checkpointed:
            from ingraph_trainer.trainer.parallel.memory import enable_gradient_checkpointing
            enable_gradient_checkpointing(family.checkpoint_blocks())
        torch.manual_seed(2)
        with torch.no_grad():  # every factor non-zero (peft starts one at zero), so every gradient is exercised
            for p in params:
                p.copy_(torch.randn(p.shape) * 0.3)
        recomputed = sum("_get_delta_activations" in vars(m) for m in family.diffusion_model.modules())
        convolutions = sum("_get_delta_activations" in vars(m) and isinstance(m.get_base_layer(), torch.nn.Conv2d)
                           for m in family.diffusion_model.modules())
        count, saved = saved_tensor_counter(family.diffusion_model)
        # a change is saved only where its layer's input needs a gradient (not the text's keys and values)
        layers = [family.diffusion_model.get_submodule(name) for name in names]
        changes = [0]
        hooks = [layer.register_forward_pre_hook(
            lambda m, args: changes.__setitem__(0, changes[0] + m.weight.numel() * params[0].element_size()
                                                if args[0].requires_grad else changes[0])) for layer in layers]
        with torch.no_grad():
            x, timestep, kwargs = family.model_inputs(batch)
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            out = family.diffusion_model(x.to(torch.bfloat16), timestep, transformer_options={}, **kwargs)
        for hook in hooks:
            hook.remove()
        loss = out.float().square().mean()
        loss.backward()
        changes = changes[0]
        return (loss.item(), [p.grad.float().clone() for p in params], sum(size for size, _ in saved.values()),
                recomputed, changes, convolutions)

    kept_loss, kept_grads, kept_saved, none, changes, _ = step(zero_stage=3)
    loss, grads, saved, recomputed, _, convolutions = step(zero_stage=0)
    assert (convolutions > 0) == (targets == "all_layers")
    # preconditions: the two paths ran, on layers whose change is saved
    assert none == 0 and recomputed > 10 and len(grads) == len(kept_grads) > 0 and changes > 0
    assert loss == pytest.approx(kept_loss, rel=1e-6)
    for mine, theirs in zip(grads, kept_grads):
        assert theirs.abs().max() > 0
        assert torch.allclose(mine, theirs, rtol=1e-3, atol=1e-6 * theirs.abs().max().item()), \
            (mine - theirs).abs().max()
    if not checkpointed:  # checkpointed blocks save their inputs alone either way
        assert kept_saved - saved >= 0.9 * changes, (kept_saved, saved, changes)


def test_rank_dropout_and_zero3_keep_peft_s_own_lokr_path():
    """A change made again must be the same change: rank dropout draws random rows, so such layers keep peft's
    path; so do layers under ZeRO-3, whose parameters are gathered around their own hooks only."""
    from ingraph_trainer.trainer.adapters import inject_adapter

    def patched(dropout: float, zero_stage: int = 0) -> int:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
        inject_adapter(model, ["0", "2"], "lokr", 2, 2.0, dropout, zero_stage)
        return sum("_get_delta_activations" in vars(m) for m in model.modules())
    assert patched(0.0) == 2
    assert patched(0.1) == 0 and patched(0.0, zero_stage=3) == 0


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_weight_change_made_again_trains_under_autocast_like_peft_s(kind):
    """Under autocast LoHa's change is made in bf16 (its factors' matmuls; LoKr's Kronecker product stays fp32)
    while the backward runs without autocast, where the change comes back in fp32: the recomputed backward casts to
    one dtype (LoHa's mixed-dtype matmul raised) and its gradients are peft's to bf16's precision; a linear and a
    convolution layer. LoKr's case, whose dtypes never differed, checks the gradients alone."""
    from ingraph_trainer.trainer.adapters import inject_adapter

    def grads(recomputed: bool):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.Flatten(2),
                                    torch.nn.Linear(36, 24))
        params = inject_adapter(model, ["0", "2"], kind, 4, 4.0, 0.0, 0 if recomputed else 3)
        with torch.no_grad():
            for p in params:  # every factor non-zero (peft starts one at zero)
                p.copy_(torch.randn(p.shape) * 0.3)
        assert sum("_get_delta_activations" in vars(m) for m in model.modules()) == (2 if recomputed else 0)
        x = torch.randn(2, 8, 6, 6, requires_grad=True)
        changes = []  # each weight change the linear layer makes, the forward's first
        make_change = model[2].get_delta_weight
        model[2].get_delta_weight = lambda *args, **kwargs: changes.append(make_change(*args, **kwargs)) or changes[-1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        # precondition: the forward made LoHa's change in bf16, what the backward's fp32 one met (LoKr's stays fp32)
        assert changes[0].dtype == (torch.bfloat16 if kind == "loha" else torch.float32), changes[0].dtype
        out.float().square().mean().backward()
        return [x.grad, *(p.grad for p in params)]

    mine, peft_s = grads(recomputed=True), grads(recomputed=False)
    assert len(mine) == len(peft_s) > 2
    for a, b in zip(mine, peft_s):
        assert b.abs().max() > 0
        assert torch.allclose(a.float(), b.float(), rtol=3e-2, atol=3e-2 * b.abs().max().item()), (a - b).abs().max()
