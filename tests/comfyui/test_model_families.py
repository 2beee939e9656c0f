"""Model families through the real ComfyUI graph: SDXL, SD3, Flux and Wan 2.1 (tiny random-weight models
that ComfyUI's UNETLoader detects as each family), the generic fallback, flow-matching objectives and
training from scratch.

Text encoders of these families (CLIP-G, T5-XXL, umT5) are too large to build in tests, so the caption
embeddings come from the test-only Synthetic Text Encoder node (tests/comfy_nodes); everything else is the
stock graph: UNETLoader, VAELoader, the pack's cache and Train nodes, LoraLoaderModelOnly, KSampler.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ON_COMFYUI_033, REPO, evaluate_on_one_image, requires_deepspeed, tiny_models
from ingraph_trainer.trainer.spec import DEFAULT_EVAL_QUANTILES_TEXT

from family_graphs import FAMILY_TINY_MODELS as TINY_MODELS, family_models  # noqa: F401  (a fixture)
from family_graphs import VAE_CHANNELS, run_events, sampling_graph, saved_latent, training_graph, write_tiny_vaes
from stage_boundaries import assert_stages_compute_the_models_loss

FLUX2_TINY_MODEL = dict(families={"flux2": "bf16"})  # ComfyUI 0.33's Flux.2: its pipeline stages' run
pytestmark = [pytest.mark.comfyui, pytest.mark.tiny_models(**TINY_MODELS),
              *([pytest.mark.tiny_models(**FLUX2_TINY_MODEL)] if ON_COMFYUI_033 else [])]


# SD3 also trains with the flow-matching options: logit-normal timesteps, SD3's shift, min-SNR and Huber, in the
# kohya layout (lora_unet_<ComfyUI module>), which ComfyUI reads back
FAMILY_OPTIONS = {"sd3": dict(timestep_sampling="logit-normal", flow_shift=3.0, min_snr_gamma=5.0, loss="Huber",
                              file_format="kohya (lora_unet_*)")}
KEY_PREFIX = {"sd3": "lora_unet_joint_blocks_"}


def trains_and_loads(comfy, client, family: str, name: str, **settings) -> list[dict]:
    """Trains 2 steps through the graph; the LoRA loads through the stock loader and changes KSampler's output.
    Returns the run's events. Evaluated on one image (conftest.evaluate_on_one_image), not the two it trains on."""
    graph = training_graph(family, name, **settings)
    evaluate_on_one_image(graph, train="8", dataset="4")
    outcome = client.run(graph, timeout=900)
    assert outcome.ok, outcome.error
    events = run_events(outcome)
    started = next(e for e in events if e["type"] == "started")
    assert started["family"] == family and started["prediction"] == ("epsilon" if family == "sdxl" else "flow")
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(e["loss"])) and 0 < e["timestep_mean"] < 1
                                   for e in steps)
    adapter = load_file(str(comfy.base_dir / "models" / "loras" / f"{name}.safetensors"))
    assert adapter and all(k.startswith(KEY_PREFIX.get(family, "diffusion_model.")) for k in adapter), sorted(adapter)[:3]

    log_before = len(comfy.log_text())
    assert client.run(sampling_graph(family, None, f"{family}_base"), timeout=600).ok
    assert client.run(sampling_graph(family, f"{name}.safetensors", f"{name}_lora"), timeout=600).ok
    log = comfy.log_text()[log_before:]
    assert "lora key not loaded" not in log and "ERROR" not in log, log[-3000:]
    base, trained = saved_latent(comfy, f"{family}_base"), saved_latent(comfy, f"{name}_lora")
    assert base.shape == trained.shape and (base - trained).abs().max() > 1e-6, "the LoRA did not change the output"
    return events


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])  # Wan: test_wan_on_two_pipeline_stages_matches_one_stage
def test_family_trains_in_the_graph_and_loads_in_lora_loader(family_models, client, family):
    trains_and_loads(family_models, client, family, f"family_{family}", **FAMILY_OPTIONS.get(family, {}))


def test_family_rejects_settings_it_cannot_honour(family_models, client):
    """A flow shift on an epsilon model and the diffusers layout on a DiT are refused with a message naming them,
    before a run directory or file is written."""
    runs = family_models.base_dir / "output" / "ingraph" / "runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    outcome = client.run(training_graph("sdxl", "rejected_shift", flow_shift=3.0), timeout=300)
    assert outcome.status == "execution_error"
    assert "train.flow_shift" in outcome.error["exception_message"] and "SDXL" in outcome.error["exception_message"]
    outcome = client.run(training_graph("wan", "rejected_format", file_format="diffusers (peft)"), timeout=300)
    assert outcome.status == "execution_error"
    assert "diffusers" in outcome.error["exception_message"] and "Wan" in outcome.error["exception_message"]
    assert (set(runs.iterdir()) if runs.exists() else set()) == before
    assert not list((family_models.base_dir / "models" / "loras").glob("rejected_*"))


def test_training_from_scratch_reduces_loss(family_models, client):
    """New Model (a freshly initialised tiny SD3 whose text widths come from the graph's text encoder, here a
    4096-wide one) → Train LoRA with a full fine-tune: the held-out loss falls, and the result loads through
    UNETLoader."""
    comfy = family_models
    model = {"class_type": "InGraphNewModel", "inputs": {"family": "SD3 (MMDiT, flow matching)", "size": "tiny",
                                                         "seed": 0, "clip": ["3", 0]}}
    outcome = client.run(training_graph("sd3", "scratch_sd3", model=model, text_family="flux", kind="Full fine-tune",
                                        steps=12, learning_rate=2e-3, timestep_sampling="logit-normal",
                                        eval_quantiles=DEFAULT_EVAL_QUANTILES_TEXT, eval_before=True), timeout=600)
    assert outcome.ok, outcome.error
    finished = next(e for e in run_events(outcome) if e["type"] == "finished")
    assert finished["eval_after"] < 0.8 * finished["eval_before"], finished
    # ComfyUI's first diffusion-models folder (models/unet on this version), where UNETLoader lists it
    assert list((comfy.base_dir / "models").glob("*/scratch_sd3.safetensors"))
    graph = sampling_graph("sd3", None, "scratch_sd3")
    graph["1"]["inputs"]["unet_name"] = "scratch_sd3.safetensors"
    graph["3"]["inputs"]["family"] = "flux"
    assert client.run(graph, timeout=300).ok
    assert torch.isfinite(saved_latent(comfy, "scratch_sd3")).all()
    # Wan's text input is fixed at 4096 wide by ComfyUI: a 64-wide encoder is refused, naming the input
    model["inputs"].update(family="Wan 2.1 (DiT, flow matching)")
    outcome = client.run(training_graph("wan", "scratch_wan", model=model, text_family="sd3", kind="Full fine-tune"),
                         timeout=300)
    assert outcome.status == "execution_error" and "clip: Wan 2.1" in outcome.error["exception_message"]


def _distributed(processes: int, stages: int) -> dict:
    return {"class_type": "InGraphDeepSpeedSettings",
            "inputs": {"processes": processes, "zero_stage": "0", "offload_optimizer": False, "hostfile": "",
                       "pipeline_stages": stages, "block_swap": 0}}


@requires_deepspeed
def test_wan_on_two_pipeline_stages_matches_one_stage(family_models, client):
    """Wan trains through the graph like every family, and split into 2 stages from the graph (DeepSpeed Settings
    node) it gives the same losses as the whole model in one process, and a LoRA the stock loader reads."""
    one = trains_and_loads(family_models, client, "wan", "family_wan")
    graph = training_graph("wan", "wan_stages2", distributed=["30", 0])
    graph["30"] = _distributed(2, 2)
    evaluate_on_one_image(graph, train="8", dataset="4")  # as trains_and_loads does
    outcome = client.run(graph, timeout=600)
    assert outcome.ok, outcome.error
    two = run_events(outcome)
    assert next(e for e in two if e["type"] == "started")["pipeline_stages"] == 2
    losses = [[e["loss"] for e in events if e["type"] == "step"] for events in (one, two)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    log_before = len(family_models.log_text())
    assert client.run(sampling_graph("wan", "wan_stages2.safetensors", "wan_stages2"), timeout=300).ok
    assert "lora key not loaded" not in family_models.log_text()[log_before:]


@requires_deepspeed
@pytest.mark.skipif(not ON_COMFYUI_033, reason="skipped: this ComfyUI has no Flux.2 (0.33 and later have)")
def test_flux2_on_two_pipeline_stages_matches_one_stage(family_models, tools, client):
    """Flux.2, whose blocks share one modulation network (computed in the first stage, its outputs carried across
    the cut), trains from the graph on 2 processes split into 2 stages (DeepSpeed Settings node) with the losses and
    the evaluation of the whole model in one process, and writes a LoRA of the same layers."""
    tiny_models(tools, family_models, **FLUX2_TINY_MODEL)
    write_tiny_vaes(family_models, {128: VAE_CHANNELS[128]})
    runs = {}
    for stages in (1, 2):
        model = {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_flux2.safetensors",
                                                        "weight_dtype": "default"}}
        graph = training_graph("flux", f"flux2_stages{stages}", model=model, text_family="flux2",
                               **({"distributed": ["30", 0]} if stages > 1 else {}))
        graph["2"]["inputs"]["vae_name"] = VAE_CHANNELS[128]
        if stages > 1:
            graph["30"] = _distributed(2, stages)
        evaluate_on_one_image(graph, train="8", dataset="4")
        outcome = client.run(graph, timeout=600)
        assert outcome.ok, outcome.error
        runs[stages] = run_events(outcome)
    started = {stages: next(e for e in events if e["type"] == "started") for stages, events in runs.items()}
    assert started[1]["family"] == started[2]["family"] == "flux2" and started[2]["pipeline_stages"] == 2
    losses = [[e["loss"] for e in runs[stages] if e["type"] == "step"] for stages in (1, 2)]
    assert len(losses[0]) == len(losses[1]) == 2 and losses[0] == pytest.approx(losses[1], abs=1e-5), losses
    evals = [[e["loss"] for e in runs[stages] if e["type"] == "eval"] for stages in (1, 2)]
    assert len(evals[0]) == len(evals[1]) >= 1 and evals[0] == pytest.approx(evals[1], abs=1e-5), evals
    loras = [load_file(str(family_models.base_dir / "models" / "loras" / f"flux2_stages{stages}.safetensors"))
             for stages in (1, 2)]
    assert loras[0] and {k: v.shape for k, v in loras[0].items()} == {k: v.shape for k, v in loras[1].items()}


def test_pipeline_layers_compute_exactly_what_the_model_computes(family_models):
    """Each family's pipeline layers, run in sequence with a stage boundary after every layer (stage_boundaries),
    give the model's own loss (to 1e-6) (SD1.5 UNet with
    its skip connections, SDXL's size embedding, SD3's, Wan's and Flux's patches on a non-square latent; Flux's
    single blocks: the next test)."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.ops
    import comfy.sd
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    from ingraph_trainer.trainer.models import Batch, family_for
    from ingraph_trainer.trainer.models.base import init_weights
    from tools.embedded_default import TINY_UNET_CONFIG
    unets = family_models.dir("models", "diffusion_models")
    cases = {  # the tiny models of the graph tests
        "sd_unet": (init_weights(UNetModel(**TINY_UNET_CONFIG, operations=comfy.ops.disable_weight_init), 0)
                    .state_dict(), (4, 8, 8), (77, 768), None),
        "sdxl": (unets / "tiny_sdxl.safetensors", (4, 8, 8), (77, 2048), 1280),
        "wan": (unets / "tiny_wan.safetensors", (16, 6, 10), (8, 4096), None),
        "sd3": (unets / "tiny_sd3.safetensors", (16, 6, 10), (8, 64), 32),
        "flux": (unets / "tiny_flux.safetensors", (16, 6, 10), (8, 4096), 64),
    }
    for name, (state, latent, text, pooled) in cases.items():
        options = {"dtype": torch.float32}
        patcher = comfy.sd.load_diffusion_model(str(state), model_options=options) if isinstance(state, Path) \
            else comfy.sd.load_diffusion_model_state_dict(dict(state), model_options=options)
        family = family_for(patcher.model, patcher=patcher)
        assert family.name == name
        g = torch.Generator().manual_seed(0)
        batch = Batch(torch.randn(2, *latent, generator=g), torch.randn(2, *text, generator=g),
                      torch.randn(2, pooled, generator=g) if pooled else None, torch.randn(2, *latent, generator=g),
                      torch.rand(2, generator=g))
        family.prepare_for_training()  # as the trainer does before it builds the stages (Flux's residuals)
        assert_stages_compute_the_models_loss(family, batch)
        with torch.no_grad():
            expected = family.loss(batch, reduce=False)
        if name == "sd_unet":  # the generic fallback trains an SD UNet exactly as the SD family does
            generic = family_for(patcher.model, family="generic", patcher=patcher)
            assert generic.adapter_targets("attention") == family.adapter_targets("attention") != []
            with torch.no_grad():
                assert torch.equal(generic.loss(batch, reduce=False), expected)


def test_flux_single_and_double_blocks_train_despite_in_place_residuals(family_models):
    """ComfyUI's Flux blocks add residuals in place into tensors their norms saved: plain backward fails. Through
    the Flux family (its out-of-place shim) the same model trains, computes the same values, and its pipeline
    layers (text and image streams joined for the single blocks) give its output bit for bit. The model is a
    narrow Flux (64 wide, one double and one single block) inside the tiny Flux's ComfyUI model."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.ldm.flux.model
    import comfy.ops
    import comfy.sd
    from ingraph_trainer.trainer.models import Batch, family_for
    from ingraph_trainer.trainer.models.base import init_weights
    patcher = comfy.sd.load_diffusion_model(str(family_models.dir("models", "diffusion_models") / "tiny_flux.safetensors"),
                                            model_options={"dtype": torch.float32})
    from ingraph_trainer.trainer.comfy_compat import build_dit
    narrow = init_weights(build_dit(
        comfy.ldm.flux.model.Flux, comfy.ldm.flux.model.FluxParams,
        in_channels=16, out_channels=16, vec_in_dim=64, context_in_dim=4096, hidden_size=64, mlp_ratio=4.0,
        num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000, patch_size=2, qkv_bias=True,
        guidance_embed=True, operations=comfy.ops.disable_weight_init), 0)
    patcher.model.diffusion_model = narrow
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.randn(2, 16, 6, 10, generator=g), torch.randn(2, 8, 4096, generator=g),
                  torch.randn(2, 64, generator=g), torch.randn(2, 16, 6, 10, generator=g), torch.rand(2, generator=g))
    narrow.requires_grad_(False)
    lora_like = [narrow.double_blocks[0].txt_attn.qkv.weight, narrow.single_blocks[0].linear1.weight]
    for param in lora_like:
        param.requires_grad_(True)
    x = batch.latents.requires_grad_(True)
    from ingraph_trainer.trainer.comfy_compat import enter_training
    enter_training()  # what prepare_for_training does (ComfyUI 0.33's rope kernels have no backward otherwise)
    with pytest.raises(RuntimeError, match="inplace operation"):
        narrow(x, torch.rand(2), torch.randn(2, 8, 4096), y=torch.randn(2, 64), guidance=torch.ones(2)).sum().backward()

    family = family_for(patcher.model, patcher=patcher)
    assert family.name == "flux"
    family.prepare_for_training()  # what load_family does in the trainer (the shim patches the blocks)
    loss = family.loss(batch)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_like)
    with torch.no_grad():
        assert family.loss(batch).item() == loss.item()
        expected = family.loss(batch, reduce=False)
        out = (batch.latents, batch.cond, batch.noise, batch.timesteps, batch.pooled)
        for layer in family.pipeline_layers():
            out = layer(out)
        got = family.loss_of_output(out, batch.latents, batch.noise, batch.timesteps, reduce=False)
    assert torch.equal(expected, got)


def test_each_objective_is_read_from_comfyuis_model_sampling_and_one_that_only_looks_alike_is_refused(monkeypatch):
    """The trainer's objective is read from ComfyUI's model_sampling class; classes that subclass a trained one but
    compute another thing are refused by name (EDM's output has the other sign, X0 and IMG_TO_IMG predict the clean
    latent, IMG_TO_IMG_FLOW starts its flow from the clean latent), not trained on a target ComfyUI never runs."""
    from tools.bootstrap import bootstrap
    bootstrap()
    import comfy.model_sampling as ms
    from ingraph_trainer.trainer.models import prediction_from_sampling

    def sampling(objective, schedule=ms.ModelSamplingDiscrete):
        return type("ModelSampling", (schedule, objective), {})(None)
    read = {"EPS": "epsilon", "V_PREDICTION": "v_prediction", "V_PREDICTION_DDPM": "v_prediction_ddpm"}
    for name, prediction in read.items():
        if hasattr(ms, name):  # V_PREDICTION_DDPM: ComfyUI 0.33's
            assert prediction_from_sampling(sampling(getattr(ms, name))) == prediction, name
    assert prediction_from_sampling(sampling(ms.CONST, ms.ModelSamplingDiscreteFlow)) == "flow"
    assert prediction_from_sampling(sampling(ms.COSMOS_RFLOW, ms.ModelSamplingCosmosRFlow)) == "flow"
    for name, schedule in (("EDM", ms.ModelSamplingContinuousEDM), ("X0", ms.ModelSamplingDiscrete),
                           ("IMG_TO_IMG", ms.ModelSamplingDiscrete), ("IMG_TO_IMG_FLOW", ms.ModelSamplingDiscreteFlow)):
        if hasattr(ms, name):
            with pytest.raises(ValueError, match=f"model: objective {name} is not supported"):
                prediction_from_sampling(sampling(getattr(ms, name), schedule))
    # a node's run reads the MODEL's objective as configured (a ModelSamplingDiscrete node upstream included), and
    # builds the family for it, for every task (trainer.graph_model.GraphModel), not the base model's own
    import types
    from ingraph_trainer.trainer import models
    from ingraph_trainer.trainer.graph_model import GraphModel
    configured = GraphModel(types.SimpleNamespace(model="the base", get_model_object=lambda name: {
        "model_sampling": sampling(ms.V_PREDICTION)}[name]))
    asked = []
    monkeypatch.setattr(models, "family_for", lambda base, prediction="auto", **_: asked.append((base, prediction)))
    configured.family()
    assert configured.prediction == "v_prediction" and asked == [("the base", "v_prediction")]
