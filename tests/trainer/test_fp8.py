"""fp8 base weights: a diffusion model loaded as UNETLoader's fp8_e4m3fn trains a LoRA with its frozen weights kept
in fp8 inside the trainer (computed in the training precision layer by layer by ComfyUI's ops), close to the same
run on a bf16 base, and the LoRA loads back onto ComfyUI's own fp8 model with every key."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from conftest import REPO, model_overrides, read_events, run_trainers_forked, write_upstream_lora

pytestmark = pytest.mark.comfyui

STEPS = 10


def test_fp8_base_weights_are_half_of_bf16_and_stay_fp8(tiny_unet):
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.adapters import FP8_DTYPES, inject_adapter
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.models import load_family
    bf16 = load_family(ModelSpec(path=str(tiny_unet)), precision="bf16")
    fp8 = load_family(ModelSpec(path=str(tiny_unet), weight_dtype="fp8_e4m3fn"), precision="bf16")
    assert fp8.base_weight_bytes() * 2 == bf16.base_weight_bytes() > 0
    layers = [m for m in fp8.diffusion_model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    params = inject_adapter(fp8.diffusion_model, fp8.adapter_targets("attention"), "lora", 4, 4.0, 0.0)
    assert params and all(p.dtype == torch.float32 for p in params)  # the adapter stays full precision
    assert fp8.base_weight_bytes() * 2 == bf16.base_weight_bytes()  # adapters are not base weights
    assert all(m.weight.dtype in FP8_DTYPES for m in layers)
    other = load_family(ModelSpec(path=str(tiny_unet), weight_dtype="fp8_e4m3fn"))
    with pytest.raises(ValueError, match="adapter.kind: DoRA needs the base weights in full precision"):
        inject_adapter(other.diffusion_model, other.adapter_targets("attention"), "dora", 4, 4.0, 0.0)


def test_fp8_lora_trains_like_bf16_and_loads_onto_comfyuis_fp8_model(prepared, tiny_unet, tmp_path, caplog):
    """Both runs compute in fp32 (bf16 convolutions are slow on CPU): the bf16 file's weights as they are against
    the same weights held in fp8, so the difference is the base's precision alone."""
    specs = {name: prepared(train__steps=STEPS, train__batch_size=2, train__precision="fp32", adapter__rank=4,
                            adapter__alpha=4.0, **model_overrides(tiny_unet, weight_dtype))
             for name, weight_dtype in (("bf16", "default"), ("fp8", "fp8_e4m3fn"))}
    proc = run_trainers_forked(*specs.values())  # each its own process, the imports shared
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {name: read_events(spec.parent) for name, spec in specs.items()}
    losses = {name: [e["loss"] for e in events if e["type"] == "step"] for name, events in runs.items()}
    evals = {name: [e["loss"] for e in events if e["type"] == "eval"] for name, events in runs.items()}
    assert len(losses["fp8"]) == len(losses["bf16"]) == STEPS
    mean = {name: sum(values) / len(values) for name, values in losses.items()}
    assert abs(mean["fp8"] - mean["bf16"]) <= 0.05 * mean["bf16"], losses
    assert len(evals["fp8"]) == len(evals["bf16"]) > 0, evals
    for fp8_loss, bf16_loss in zip(evals["fp8"], evals["bf16"]):
        assert abs(fp8_loss - bf16_loss) <= 0.05 * bf16_loss, evals
    started = runs["fp8"][0]
    if "base_weight_bytes" in started:  # the trainer reports it once loop.py emits it (bf16 file held in fp32)
        assert started["base_weight_bytes"] * 4 == runs["bf16"][0]["base_weight_bytes"]
    lora = runs["fp8"][-1]["adapter"]

    # ComfyUI's own UNETLoader (fp8_e4m3fn) and LoraLoaderModelOnly, in this process
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import folder_paths
    import nodes
    folder_paths.add_model_folder_path("diffusion_models", str(tiny_unet.parent))
    folder_paths.add_model_folder_path("loras", str(tmp_path))
    (tmp_path / "fp8_lora.safetensors").write_bytes(open(lora, "rb").read())
    model = nodes.UNETLoader().load_unet(tiny_unet.name, "fp8_e4m3fn")[0]
    assert model.model.diffusion_model.input_blocks[0][0].weight.dtype == torch.float8_e4m3fn
    with caplog.at_level(logging.WARNING):
        patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, "fp8_lora.safetensors", 1.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()
                or "NOT LOADED" in r.getMessage()], caplog.text
    assert len(patched.patches) == runs["fp8"][0]["adapted_modules"] > 0


def test_the_evaluate_task_keeps_an_fp8_base_in_fp8_and_evaluates_it_like_bf16(prepared, tiny_unet):
    """Issue 30: the evaluate task (the Evaluate node's trainer) cast every weight to the training precision, so
    an fp8 base was evaluated as a bf16 model twice its size (Flux fp8: 24 GB). It now holds the base as training
    does: fp8 stays fp8, computed in bf16 layer by layer, and the loss is the bf16 base's to a few percent."""
    specs = {name: prepared(task="evaluate", output__lora_path="", train__precision="bf16",
                            **ONE_EVAL, **model_overrides(tiny_unet, weight_dtype))
             for name, weight_dtype in (("bf16", "default"), ("fp8", "fp8_e4m3fn"))}
    proc = run_trainers_forked(*specs.values())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {name: read_events(spec.parent) for name, spec in specs.items()}
    started = {name: next(e for e in events if e["type"] == "started") for name, events in runs.items()}
    assert all(s.get("task") == "evaluate" for s in started.values())
    assert started["fp8"]["base_weight_bytes"] * 2 == started["bf16"]["base_weight_bytes"] > 0
    loss = {name: next(e for e in events if e["type"] == "eval")["loss"] for name, events in runs.items()}
    assert abs(loss["fp8"] - loss["bf16"]) <= 0.05 * loss["bf16"], loss


ONE_EVAL = dict(train__eval_quantiles=[0.5], train__eval_items=2)


def _one_step_saved_bytes(family, savers: bool, latent_hw: tuple[int, int], monkeypatch) -> tuple[int, list]:
    """One LoRA step's saved-tensor bytes (each storage once, as autograd holds it for the backward pass) and the
    adapter's gradients, with the trainer's memory settings applied (the defaults: no checkpointing) or not.
    Saved-tensor hooks do not nest: inside a layer that casts its weight again, the layer's own hook sees what it
    saves, so that hook's kept tensors are counted too."""
    from ingraph_trainer.trainer.parallel import memory
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.models import Batch
    torch.manual_seed(0)
    params = inject_adapter(family.diffusion_model, family.adapter_targets("attention_ff"), "lora", 4, 4.0, 0.0)
    for p in params:  # peft starts lora_B at zero: make every adapter weight's gradient depend on the base
        torch.nn.init.normal_(p, std=0.05)
    family.prepare_for_training()
    if savers:
        memory.memory_savers(family, False, 0)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, *latent_hw, generator=g)
    batch = Batch(latents, torch.randn(2, 77, 768, generator=g), None, torch.randn(latents.shape, generator=g),
                  torch.tensor([0.3, 0.7]))
    storages = {}

    def count(t):
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    layer_pack = memory.pack_for_backward
    monkeypatch.setattr(memory, "pack_for_backward", lambda layer, found, t: count(layer_pack(layer, found, t)))
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        loss = family.loss(batch)
    loss.backward()
    monkeypatch.setattr(memory, "pack_for_backward", layer_pack)
    return sum(storages.values()), [p.grad.clone() for p in params]


# 16x16 latents; 16x10, where a layer norm's statistics (batch x tokens rows) have as many elements as a 320-wide
# weight, which a size rule took for the weight's copy (the gradients were off by a third)
@pytest.mark.parametrize("latent_hw", [(16, 16), (16, 10)])
def test_an_fp8_base_saves_no_more_for_backward_than_bf16_and_the_same_gradients(tiny_unet, latent_hw,
                                                                                  monkeypatch):
    """Issue 30: a frozen fp8 layer computes with a bf16 copy of its weight, which autograd kept for the backward
    pass, so an fp8 base held more than a bf16 one (an H200 run: 4.44 against 3.68 GiB). With the trainer's memory
    settings (no checkpointing) the copy is cast again in backward instead: one step saves at most the bf16 base's
    bytes, and the adapter's gradients are bit for bit those of the fp8 base without it."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.models import load_family

    def family(weight_dtype):
        return load_family(ModelSpec(path=str(tiny_unet), weight_dtype=weight_dtype), precision="bf16")
    bf16_bytes, _ = _one_step_saved_bytes(family("default"), True, latent_hw, monkeypatch)
    before_bytes, before = _one_step_saved_bytes(family("fp8_e4m3fn"), False, latent_hw, monkeypatch)
    fp8_bytes, after = _one_step_saved_bytes(family("fp8_e4m3fn"), True, latent_hw, monkeypatch)
    print(f"\none step's saved bytes at latents {latent_hw}: bf16 base {bf16_bytes:,}, fp8 base {before_bytes:,} "
          f"before, {fp8_bytes:,} now")
    assert before_bytes > bf16_bytes  # the precondition: the bf16 copies cost more than fp8 saves in storage
    assert fp8_bytes <= bf16_bytes, (fp8_bytes, bf16_bytes, before_bytes)
    assert len(before) == len(after) > 0 and any(g.abs().sum() > 0 for g in after)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_layer_whose_forward_scales_its_weight_keeps_its_copy():
    """A weight the forward changes beyond ComfyUI's cast (0.3.64's scaled fp8 multiplies it by scale_weight) is
    not what casting again gives: the first check finds the difference and the layer keeps saving its copy, so its
    gradient stays exact."""
    from ingraph_trainer.trainer.parallel.memory import keep_fp8_weights_for_backward
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.ops

    class Scaled(comfy.ops.manual_cast.Linear):
        def forward_comfy_cast_weights(self, input):
            weight, bias = comfy.ops.cast_bias_weight(self, input)
            return torch.nn.functional.linear(input, weight * 4.0, bias)

    torch.manual_seed(0)
    layer = Scaled(8, 8)
    layer.weight = torch.nn.Parameter(torch.randn(8, 8).to(torch.float8_e4m3fn), requires_grad=False)
    layer.bias = None
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).square().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    assert keep_fp8_weights_for_backward(torch.nn.Sequential(layer)) == 1
    layer(x).square().sum().backward()
    assert layer._ingraph_cast_again_checked is False
    assert torch.equal(x.grad, expected)


def test_a_full_fine_tune_of_fp8_weights_is_refused_naming_the_file():
    import torch
    from ingraph_trainer.trainer.tasks.loop import refuse_fp8_full_fine_tune
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    refuse_fp8_full_fine_tune(model, "plain.safetensors")  # full precision: nothing to refuse
    model[1].weight.data = model[1].weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scaled_fp8\.safetensors holds 1 fp8 weights \(such as 1\.weight\)"):
        refuse_fp8_full_fine_tune(model, "scaled_fp8.safetensors")


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e4m3fn_fast"])
def test_an_fp8_base_with_a_lora_upstream_loads_in_the_trainer(tiny_unet, tmp_path, weight_dtype):
    """UNETLoader fp8 → a LoRA → Evaluate (or Train): the trainer bakes the LoRA into the fp8 weights with ComfyUI's
    patching code, whose fp8 rounding refused weights that require grad (clamp(out=...), seen on an H100 and here);
    the baked weights stay fp8 and differ from the plain base where the LoRA applies."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from safetensors.torch import load_file, save_file
    from ingraph_trainer.trainer.spec import ModelSpec
    from ingraph_trainer.trainer.models import load_base_model
    as_checkpoint = tmp_path / "as_checkpoint.safetensors"  # write_upstream_lora reads a checkpoint's key names
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(tiny_unet).items()}, as_checkpoint)
    lora = tmp_path / "upstream.safetensors"
    write_upstream_lora(as_checkpoint, lora)
    plain = load_base_model(ModelSpec(path=str(tiny_unet), weight_dtype=weight_dtype), "bf16")
    patched = load_base_model(ModelSpec(path=str(tiny_unet), weight_dtype=weight_dtype, lora_paths=[str(lora)],
                                        lora_strengths=[1.0]), "bf16")
    name = "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    before, after = (p.model.diffusion_model.get_parameter(name) for p in (plain, patched))
    assert after.dtype == torch.float8_e4m3fn
    assert not torch.equal(before.float(), after.float())
