"""The one module that meets what differs between ComfyUI versions (trainer/comfy_compat.py): wrappers take whatever
the wrapped ComfyUI function takes, and model configs gain the fields a newer ComfyUI requires. No ComfyUI needed:
a stand-in for its classes carries the newer signatures, so each test fails on the narrower code it guards."""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from ingraph_trainer.trainer import comfy_compat
from ingraph_trainer.trainer.models import loading


class _FutureBaseModel:
    """ComfyUI 0.33's BaseModel.load_model_weights signature, plus a keyword a later ComfyUI might add."""
    calls: list = []

    def load_model_weights(self, sd, unet_prefix="", assign=False, later_keyword=None):
        self.calls.append((sd, unet_prefix, assign, later_keyword))
        return self


@pytest.fixture
def comfy_model_base(monkeypatch):
    module = types.ModuleType("comfy.model_base")
    module.BaseModel = _FutureBaseModel
    package = sys.modules.get("comfy") or types.ModuleType("comfy")
    monkeypatch.setitem(sys.modules, "comfy", package)
    monkeypatch.setitem(sys.modules, "comfy.model_base", module)
    monkeypatch.setattr(package, "model_base", module, raising=False)
    _FutureBaseModel.calls = []
    return module


def test_the_load_wrapper_passes_every_argument_comfyui_gives(comfy_model_base, tmp_path):
    """0.33 calls load_model_weights(sd, prefix, assign=...): the pack's wrapper refused `assign` and every model
    load failed. Positional, keyword and unknown arguments reach ComfyUI's method unchanged."""
    model = _FutureBaseModel()
    model.diffusion_model = types.SimpleNamespace(modules=lambda: [])
    original = _FutureBaseModel.__dict__["load_model_weights"]
    with loading.released_after_copy(str(tmp_path / "model.safetensors")) as report:
        assert _FutureBaseModel.__dict__["load_model_weights"] is not original  # the wrapper is installed
        model.load_model_weights({"a": 1}, "model.", assign=True, later_keyword=7)
        model.load_model_weights({"b": 2}, "x.", False)
        model.load_model_weights({"c": 3}, unet_prefix="y.", later_keyword="z")
    assert _FutureBaseModel.__dict__["load_model_weights"] is original  # put back
    assert _FutureBaseModel.calls == [({"a": 1}, "model.", True, 7), ({"b": 2}, "x.", False, None),
                                      ({"c": 3}, "y.", False, "z")]
    assert report["released_bytes"] == 0


def test_a_partitioned_load_that_must_load_whole_checks_the_host_again_before_anything_is_filled(comfy_model_base,
                                                                                                 tmp_path):
    """ZeRO-3's RAM check counted one share of the weights; where the model turns out to need a whole load (a layer
    that loads its weights its own way, or 0.33's dynamic VRAM taking the file's tensors), the check for a whole copy
    runs first, and its refusal stops the load before ComfyUI fills anything."""
    import torch

    class OwnLoader(torch.nn.Module):  # as a scaled-fp8 or quantized layer: its own _load_from_state_dict
        def _load_from_state_dict(self, *args, **kwargs):
            return super()._load_from_state_dict(*args, **kwargs)
    model = _FutureBaseModel()
    model.diffusion_model = torch.nn.Sequential(OwnLoader())
    checked = []

    def refuse(why):
        checked.append((why, len(_FutureBaseModel.calls)))
        raise MemoryError(f"refused: {why}")
    for assign in (False, True):
        with loading.released_after_copy(str(tmp_path / "model.safetensors"), {}, refuse):
            with pytest.raises(MemoryError, match="refused"):
                model.load_model_weights({"a": 1}, "model.", assign=assign)
    assert [calls for _, calls in checked] == [0, 0] and _FutureBaseModel.calls == []  # nothing reached ComfyUI
    assert "OwnLoader" in checked[0][0] and "dynamic VRAM" in checked[1][0]
    with loading.released_after_copy(str(tmp_path / "model.safetensors"), None, refuse):
        model.load_model_weights({"a": 1}, "model.")  # no partitioned load asked: no second check
    assert len(checked) == 2 and len(_FutureBaseModel.calls) == 1


def test_wrap_method_puts_the_original_back_after_an_error():
    class Owner:
        def method(self, a, b=1, **kw):
            return (a, b, kw)

    def make(original):
        def wrapped(self, *args, **kwargs):
            raise ValueError("inside")
        return wrapped
    with pytest.raises(ValueError):
        with comfy_compat.wrap_method(Owner, "method", make):
            Owner().method(1)
    assert Owner().method(1, b=2, c=3) == (1, 2, {"c": 3})


def test_dit_config_fills_only_the_newer_required_fields():
    @dataclasses.dataclass
    class FluxParams:  # as 0.33 has it: txt_ids_dims required, vec_in_dim required, newer optional ones defaulted
        hidden_size: int
        vec_in_dim: int
        txt_ids_dims: list
        global_modulation: bool = False

    config = comfy_compat.dit_config(FluxParams, {"hidden_size": 64, "vec_in_dim": 768})
    assert config == {"hidden_size": 64, "vec_in_dim": 768, "txt_ids_dims": []}
    FluxParams(**config)
    assert comfy_compat.dit_config(FluxParams, {"hidden_size": 64, "vec_in_dim": 768,
                                                "txt_ids_dims": [3]})["txt_ids_dims"] == [3]
    # per class: Chroma's vec_in_dim default is not Flux's (a Flux config that leaves it out stays incomplete)
    assert "vec_in_dim" not in comfy_compat.dit_config(FluxParams, {"hidden_size": 64})
    # the list is the caller's own: a model that appends to it leaves the table alone
    config["txt_ids_dims"].append(1)
    assert comfy_compat.LEGACY_DIT_FIELDS["FluxParams"]["txt_ids_dims"] == []

    @dataclasses.dataclass
    class ChromaParams:  # 0.3.64: no such field, nothing added
        hidden_size: int
    assert comfy_compat.dit_config(ChromaParams, {"hidden_size": 64}) == {"hidden_size": 64}


def test_comfyui_version_reads_the_installs_own_file(tmp_path):
    (tmp_path / "comfyui_version.py").write_text('__version__ = "0.33.0"\n')
    assert comfy_compat.comfyui_version(tmp_path) == (0, 33, 0)
    assert comfy_compat.comfyui_version(tmp_path / "missing") == ()


def test_wrap_method_refuses_a_wrapper_narrower_than_anything_comfyui_may_pass():
    class Owner:
        def method(self, a, b=1):
            return (a, b)

    def narrow(original):
        def wrapped(self, a, b=1):  # what broke every load when 0.33 added `assign`
            return original(self, a, b)
        return wrapped
    with pytest.raises(TypeError, match=r"the wrapper of Owner.method must take \*args and \*\*kwargs"):
        with comfy_compat.wrap_method(Owner, "method", narrow):
            pass
    assert Owner().method(1) == (1, 1)  # nothing was installed


def test_dequantizing_one_layer_leaves_every_other_layer_alone():
    """ComfyUI's op classes hold `weight_function` as a class-level list until a load gives a layer one of its own:
    an append to it (as dequantize_per_matmul did) made every layer of every model in the process cast per call
    (found when the memory plan's test ran after the 4-bit tests: every layer of a fresh bf16 model had it)."""
    class Op:  # comfy.ops.CastWeightBiasOp's shape
        weight_function = []
        bias_function = []
    quantized, other = Op(), Op()
    comfy_compat.dequantize_per_matmul(quantized)
    comfy_compat.dequantize_per_matmul(quantized)  # twice: still one
    assert Op.weight_function == [] and other.weight_function == []
    assert len(quantized.weight_function) == 1 and quantized.comfy_force_cast_weights


VAE_LOADER_0_3_64 = '''class VAELoader:
    def load_vae(self, vae_name):
        sd = comfy.utils.load_torch_file(vae_path)
        vae = comfy.sd.VAE(sd=sd)
        return (vae,)

class ControlNetLoader:
    pass
'''
VAE_LOADER_0_33 = VAE_LOADER_0_3_64.replace("load_torch_file(vae_path)", "load_torch_file(vae_path, return_metadata=True)")


@pytest.mark.parametrize("loader, passed", [(VAE_LOADER_0_3_64, False), (VAE_LOADER_0_33, True)])
def test_a_vae_file_is_read_with_its_metadata_only_where_comfyuis_vae_loader_passes_it(monkeypatch, tmp_path, loader,
                                                                                       passed):
    """0.33's VAELoader hands a file's metadata to comfy.sd.VAE (an LTX-Video VAE's configuration, taef2's latent
    width), 0.3.64's does not; the previews' VAE in the trainer is built as the graph's own was."""
    (tmp_path / "comfy").mkdir()
    (tmp_path / "comfy" / "sd.py").write_text("")
    (tmp_path / "nodes.py").write_text("class LoadImage:\n    return_metadata=True\n\n" + loader)
    built = []
    sd = types.ModuleType("comfy.sd")
    sd.__file__ = str(tmp_path / "comfy" / "sd.py")
    sd.VAE = lambda sd=None, metadata=None: built.append(metadata)
    utils = types.ModuleType("comfy.utils")
    utils.load_torch_file = lambda path, safe_load=False, return_metadata=False: (
        {"w": 0}, {"config": "{}", "tae_latent_channels": "128"})
    package = types.ModuleType("comfy")
    package.sd, package.utils = sd, utils
    monkeypatch.setitem(sys.modules, "comfy", package)
    monkeypatch.setitem(sys.modules, "comfy.sd", sd)
    monkeypatch.setitem(sys.modules, "comfy.utils", utils)
    comfy_compat.vae_loader_reads_metadata.cache_clear()
    try:
        comfy_compat.load_vae_file("vae.safetensors", from_checkpoint=False)
    finally:
        comfy_compat.vae_loader_reads_metadata.cache_clear()
    assert built == [{"config": "{}", "tae_latent_channels": 128} if passed else None]


def test_a_preload_builds_the_model_in_host_memory_whatever_device_comfyui_would_pick(monkeypatch):
    """loads_to_host: ComfyUI's choice of the device a loaded model is built on (unet_inital_load_device, which
    picks the GPU where it has more free memory than the host) answers the CPU inside the block, and is its own
    again after; the function is there, by that name, in the ComfyUI under test."""
    import torch

    from conftest import comfyui_available, comfyui_path
    module = types.ModuleType("comfy.model_management")
    module.unet_inital_load_device = lambda parameters, dtype: torch.device("cuda")
    package = sys.modules.get("comfy") or types.ModuleType("comfy")
    monkeypatch.setitem(sys.modules, "comfy", package)
    monkeypatch.setitem(sys.modules, "comfy.model_management", module)
    monkeypatch.setattr(package, "model_management", module, raising=False)
    with comfy_compat.loads_to_host():
        assert module.unet_inital_load_device(10**9, torch.float16) == torch.device("cpu")
    assert module.unet_inital_load_device(10**9, torch.float16) == torch.device("cuda")
    if comfyui_available():
        source = (comfyui_path() / "comfy" / "model_management.py").read_text(encoding="utf-8")
        assert "def unet_inital_load_device(" in source


def test_comfy_kitchens_rotary_ops_get_the_backward_of_its_eager_implementation():
    """ComfyUI 0.33's JoyImage and Cosmos Predict2 attention call comfy-kitchen's fused RMS-norm-and-rotary ops in
    training too, and those ops have no backward: trainer/kitchen_autograd.py gives each the backward of
    comfy-kitchen's own eager (plain torch) implementation. Through the op, every input's gradient is the eager
    implementation's; without the registration the op's backward raises."""
    import torch
    try:
        from comfy_kitchen.backends.eager import rope as eager
    except ImportError:
        pytest.skip("no comfy-kitchen here (ComfyUI 0.3.64's environment); the ComfyUI 0.33 tier runs this test")
    from ingraph_trainer.trainer.kitchen_autograd import OPS, register_backwards
    register_backwards()
    assert {"rms_rope", "rms_rope_split_half"} <= set(OPS)
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator)
    q, k, freqs, q_scale, k_scale = leaf(2, 6, 2, 8), leaf(2, 6, 2, 8), leaf(1, 6, 1, 4, 2, 2), leaf(8), leaf(8)
    arguments = {"apply_rope": (q, k, freqs), "apply_rope1": (q, freqs), "apply_rope_split_half": (q, k, freqs),
                 "apply_rope_split_half1": (q, freqs),
                 "rms_rope": (q, k, freqs, q_scale, k_scale, 1e-6), "rms_rope1": (q, freqs, q_scale, 1e-6),
                 "rms_rope_split_half1": (q, freqs, q_scale, 1e-6),
                 "rms_rope_split_half": (q, k, freqs, q_scale, k_scale, 1e-6, 0)}
    assert sorted(arguments) == sorted(OPS)
    for name, args in arguments.items():
        grads = []
        for function in (getattr(torch.ops.comfy_kitchen, name), getattr(eager, name)):
            leaves = [a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args]
            outputs = function(*leaves)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            sum((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum()
                for out in outputs).backward()
            grads.append([a.grad for a in leaves if isinstance(a, torch.Tensor)])
        assert all(g is not None for g in grads[0]), name
        for through_op, through_eager in zip(*grads, strict=True):
            torch.testing.assert_close(through_op, through_eager, rtol=0, atol=0, msg=name)
    # a layer adapted on one side only: the query wants a gradient, the key and its norm scale do not
    query = q.clone().requires_grad_(True)
    out_q, out_k = torch.ops.comfy_kitchen.rms_rope(query, k, freqs, q_scale, k_scale, 1e-6)
    (out_q.sum() + out_k.sum()).backward()
    reference = q.clone().requires_grad_(True)
    eager.rms_rope(reference, k, freqs, q_scale, k_scale, 1e-6)[0].sum().backward()
    torch.testing.assert_close(query.grad, reference.grad, rtol=0, atol=0)
