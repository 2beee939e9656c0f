"""Caption dropout, masked loss and prior images wired into training: the loop's batches carry them, the loss
applies them, the step events report the training and prior images' losses apart, the graph and a hand-written
spec reach them, and pipeline stages refuse what they cannot apply.

One trainer launch for the whole feature set (fp32, the tiny SD1.5 model); the rest is unit tier.
"""
from __future__ import annotations

import importlib
import math
import shutil
import types
from pathlib import Path

import pytest
import torch

from conftest import read_events, requires_deepspeed, run_trainer

config = importlib.import_module("ingraph_trainer.trainer.spec")
mix = importlib.import_module("ingraph_trainer.trainer.data.batch_mix")

STEPS, PRIOR_WEIGHT = 3, 0.5


# --- the loss ------------------------------------------------------------------------------------------------

def tiny_sd_family():
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.ops
    import comfy.sd
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    from ingraph_trainer.trainer.models import family_for
    from ingraph_trainer.trainer.models.base import init_weights
    from tools.embedded_default import TINY_UNET_CONFIG
    state = init_weights(UNetModel(**TINY_UNET_CONFIG, operations=comfy.ops.disable_weight_init), 0).state_dict()
    patcher = comfy.sd.load_diffusion_model_state_dict(state, model_options={"dtype": torch.float32})
    return family_for(patcher.model, patcher=patcher)


@pytest.mark.comfyui
def test_the_training_module_applies_masks_and_sample_weights_and_splits_prior_losses():
    from ingraph_trainer.trainer.models import Batch
    from ingraph_trainer.trainer.training_module import TrainingModule
    family = tiny_sd_family()
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    cond, timesteps = torch.randn(2, 77, 768, generator=g), torch.rand(2, generator=g)
    mask = torch.ones(2, 1, 8, 8)
    mask[..., 4:] = 0.0  # the right half of every image does not train
    # the family's loss takes the mask: no gradient from the right half of the prediction
    prediction = torch.randn(2, 4, 8, 8, generator=g, requires_grad=True)
    family.loss_of_output(prediction, latents, noise, timesteps, reduce=False, mask=mask).sum().backward()
    assert torch.all(prediction.grad[..., 4:] == 0) and torch.all(prediction.grad[..., :4] != 0)

    module = TrainingModule(family)
    with torch.no_grad():
        plain = module(latents, cond, noise, timesteps, None)
        assert torch.equal(plain, family.loss(Batch(latents, cond, None, noise, timesteps)))  # as before
        per_sample = family.loss(Batch(latents, cond, None, noise, timesteps, mask), reduce=False)
        weight, is_prior = torch.tensor([PRIOR_WEIGHT, 1.0]), torch.tensor([True, False])
        loss, parts = module(latents, cond, noise, timesteps, None, mask=mask, sample_weight=weight,
                             is_prior=is_prior)
    assert not torch.equal(per_sample, family.loss(Batch(latents, cond, None, noise, timesteps), reduce=False))
    assert torch.equal(loss, (per_sample * weight).mean())
    assert mix.split_losses(parts) == pytest.approx({"main_loss": per_sample[1].item(),
                                                     "prior_loss": per_sample[0].item()})


class _Engine:
    """DeepSpeed's engine as WholeModel drives it: records what each micro-batch is called with."""

    def __init__(self):
        self.device, self.calls = torch.device("cpu"), []

    def __call__(self, *args, **features):
        self.calls.append((len(args), sorted(features)))
        per_sample = args[0].flatten(1).mean(1)
        loss = (per_sample * features["sample_weight"]).mean() if "sample_weight" in features else per_sample.mean()
        return (loss, mix.loss_parts(per_sample, features["is_prior"])) if "is_prior" in features else loss

    def backward(self, loss):
        pass

    def is_gradient_accumulation_boundary(self):
        return False

    def step(self):
        pass

    def get_global_grad_norm(self):
        return 1.0


def test_a_step_passes_the_features_to_the_model_and_reports_main_and_prior_loss_with_one_read_back(monkeypatch):
    from ingraph_trainer.trainer.parallel import layouts
    layout = object.__new__(layouts.WholeModel)
    layout.trainable, layout._own_grad_norm, layout.loss_split = [], False, {}
    layout.engine = _Engine()
    # per-sample losses: 1 and 11 in the first micro-batch, 3 and 13 in the second
    latents = [torch.stack([torch.full((1, 2, 2), v), torch.full((1, 2, 2), v + 10)]) for v in (1.0, 3.0)]
    plain = [mix.MicroBatch(x, x, x, torch.zeros(2), None) for x in latents]
    assert layout.train_step(plain)[0] == 7.0 and layout.loss_split == {}
    assert layout.engine.calls == [(5, []), (5, [])]  # a plain run calls the model exactly as before
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _o=original, _n=name: reads.append(_n) or _o(self))
    mixed = [mix.MicroBatch(x, x, x, torch.zeros(2), None, torch.ones(2, 1, 2, 2), torch.tensor([PRIOR_WEIGHT, 1.0]),
                            torch.tensor([True, False])) for x in latents]
    loss, _ = layout.train_step(mixed)
    assert reads == ["tolist"]  # the step's losses and their training/prior parts come back in one transfer
    assert layout.engine.calls[2:] == [(5, ["is_prior", "mask", "sample_weight"])] * 2
    assert loss == ((0.5 * 1 + 11) / 2 + (0.5 * 3 + 13) / 2) / 2
    assert layout.loss_split == {"main_loss": 12.0, "prior_loss": 2.0}


# --- pipeline stages --------------------------------------------------------------------------------------------

def test_pipeline_stages_refuse_prior_images_masks_sound_and_references_they_do_not_pass_by_field():
    from ingraph_trainer.trainer.models.stages import StageInput
    from ingraph_trainer.trainer.parallel.pipeline import ContiguousOutputs, check_data
    spec = config.RunSpec(run_dir="run", model=config.ModelSpec(path="model.safetensors"),
                          data=config.DataSpec(manifest="d.json", prior_manifest="p.json"),
                          distributed=config.DistributedSpec(processes=2, pipeline_stages=2))
    with pytest.raises(config.RunSpecError, match=r"data\.prior_manifest: prior images are not available with "
                                                  r"pipeline stages"):
        spec.validate()
    masked = type("Cached", (), {"masked": [False, True]})()
    family = type("Family", (), {"display_name": "Chroma"})()
    layers = [ContiguousOutputs(type("Begin", (StageInput,), {})(family))]  # takes no reference images
    with pytest.raises(ValueError, match=r"data\.prior_manifest: prior images are not available"):
        check_data(config.DataSpec(manifest="d.json", prior_manifest="p.json"), masked, layers)
    with pytest.raises(ValueError, match=r"data\.masked_loss: d\.json has loss masks, which pipeline stages"):
        check_data(config.DataSpec(manifest="d.json"), masked, layers)
    check_data(config.DataSpec(manifest="d.json", masked_loss=False), masked, layers)  # masks off: trains
    with pytest.raises(ValueError, match=r"data\.manifest: d\.json has clips with sound \(audio latents\), which "
                                         r"pipeline stages"):  # LTX-2's audio stream: the stages carry video alone
        check_data(config.DataSpec(manifest="d.json"), type("Cached", (), {"masked": [], "audio": True})(), layers)
    check_data(config.DataSpec(manifest="d.json", caption_dropout=0.3), type("Cached", (), {"masked": []})(), layers)
    edit_pairs = type("Cached", (), {"masked": [], "reference_slots": 1})()
    with pytest.raises(ValueError, match=r"data\.manifest: its items carry reference images, which Chroma's pipeline "
                                         r"stages \(distributed\.pipeline_stages > 1\) do not pass on yet"):
        check_data(config.DataSpec(manifest="d.json"), edit_pairs, layers)
    layers[0].layer.takes_references = True  # Qwen-Image-Edit's, Flux Kontext's and Flux.2's first layers
    check_data(config.DataSpec(manifest="d.json"), edit_pairs, layers)


def test_pipeline_stages_hand_each_micro_batchs_reference_images_to_the_first_layer():
    """What the pipeline engine is given for a step (PipelineStages.train_step through pipeline.micro_batch) is read
    back by the first layer (StageInput.model_inputs) as the micro-batch it came from: the pooled vector where there
    is one, the reference images (edit pairs) after it, with and without a pooled vector."""
    from ingraph_trainer.trainer.data.batch_mix import MicroBatch
    from ingraph_trainer.trainer.models.stages import StageInput
    from ingraph_trainer.trainer.parallel.layouts import PipelineStages
    given = []
    stages = PipelineStages.__new__(PipelineStages)
    stages.engine = types.SimpleNamespace(train_batch=lambda batches: given.extend(batches) or torch.tensor(0.5),
                                          get_global_grad_norm=lambda: 1.0)
    read = []
    first = type("Begin", (StageInput,), {})(types.SimpleNamespace(model_inputs=read.append))
    g = torch.Generator().manual_seed(0)
    latents, cond, noise, t = (torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 7, 16, generator=g),
                               torch.randn(2, 4, 8, 8, generator=g), torch.rand(2, generator=g))
    pooled, references = torch.randn(2, 32, generator=g), [torch.randn(2, 4, 6, 8), torch.randn(2, 4, 8, 6)]
    micro = [MicroBatch(latents, cond, noise, t, None, references=references),
             MicroBatch(latents, cond, noise, t, pooled, references=references),
             MicroBatch(latents, cond, noise, t, pooled), MicroBatch(latents, cond, noise, t, None)]
    assert stages.train_step(micro) == (0.5, 1.0)
    assert len(given) == 4
    for (inputs, labels), m in zip(given, micro, strict=True):
        first.model_inputs(inputs)
        batch = read[-1]
        assert all(a is b for a, b in zip(labels, (latents, noise, t), strict=True))
        assert batch.latents is latents and batch.cond is cond and batch.noise is noise and batch.timesteps is t
        assert batch.pooled is m.pooled
        assert len(batch.references or []) == len(m.references or []) and \
            all(a is b for a, b in zip(batch.references or [], m.references or []))


def test_a_pipeline_stage_that_would_train_nothing_is_found_from_the_partition():
    """DeepSpeed partitions the layers by trained parameters; a stage left with none (fewer trained layers than
    stages) would fail on one process with "optimizer got an empty parameter list": pipeline.build refuses on every
    process, naming the setting, from the partition they all know."""
    from ingraph_trainer.trainer.parallel.pipeline import stages_training_nothing
    trained, frozen = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).requires_grad_(False)
    layers = [frozen, trained, frozen]
    assert stages_training_nothing(layers, [0, 2, 3]) == [1]
    assert stages_training_nothing(layers, [0, 1, 3]) == [0]
    assert stages_training_nothing([frozen, trained, trained], [0, 2, 3]) == []


@requires_deepspeed
def test_a_middle_stage_receives_each_tensor_in_its_own_dtype_where_deepspeed_would_reuse_another():
    """DeepSpeed's pipeline engine receives activations and gradients into one pool of buffers by tuple position and
    reuses a large enough one whatever its dtype. A middle stage (3 stages or more) receiving Flux.2's double-block
    tuple (an integer shape at position 4) after a float gradient came back at position 4 would get a float view:
    its own method, on an engine's state, does that; with pipeline.receive_buffers_by_dtype each position gets the
    dtype asked for, and a same-dtype position is still reused."""
    import types

    from deepspeed.runtime.pipe.engine import PipelineEngine
    from ingraph_trainer.trainer.parallel.pipeline import receive_buffers_by_dtype

    def engine():
        state = types.SimpleNamespace(_grad_layer_buf=[], num_pipe_buffers=1, device="cpu")
        for name in ("_allocate_or_extend_buffers", "_allocate_buffer", "_allocate_zeros"):
            setattr(state, name, types.MethodType(getattr(PipelineEngine, name), state))
        return state

    gradients = [([2, 24, 128], torch.float32)] * 5  # the floats of what the stage sent: a modulation's at 4
    received = [([2, 24, 128], torch.float32)] * 4 + [([2], torch.int64)]  # the next micro-batch: the shape at 4

    def receive(state, tensors):  # as _exec_recv_grads and _recv_tensor_meta ask, position by position
        return [state._allocate_or_extend_buffers(i, shape, dtype) for i, (shape, dtype) in enumerate(tensors)]

    plain = engine()
    receive(plain, gradients)
    assert receive(plain, received)[4].dtype == torch.float32  # DeepSpeed's own reuse: a float view for the shape
    fixed = engine()
    receive_buffers_by_dtype(fixed)
    first = receive(fixed, gradients)
    buffers = receive(fixed, received)
    assert [b.dtype for b in buffers] == [dtype for _, dtype in received] and buffers[4].shape == (2,)
    assert buffers[0].data_ptr() == first[0].data_ptr()  # a position whose dtype stays is reused as before
    assert receive(fixed, received)[4].data_ptr() == buffers[4].data_ptr()


# --- one run with every feature --------------------------------------------------------------------------------

def feature_folders(root: Path, images: Path) -> tuple[Path, Path]:
    """The embedded images, each with a mask that leaves its right half out; and four of them, recaptioned, as
    prior images (same 64x64 bucket)."""
    from PIL import Image
    train, prior = root / "train", root / "prior"
    for folder in (train, prior):
        folder.mkdir(parents=True)
    for n, image in enumerate(sorted(images.glob("*.png"))):
        shutil.copy(image, train / image.name)
        shutil.copy(image.with_suffix(".txt"), train / image.with_suffix(".txt").name)
        w, h = Image.open(image).size
        mask = Image.new("L", (w, h), 255)
        mask.paste(0, (w // 2, 0, w, h))
        mask.save(train / f"{image.stem}.mask.png")
        if n < 4:
            shutil.copy(image, prior / image.name)
            (prior / f"{image.stem}.txt").write_text("a circle", encoding="utf-8")
    return train, prior


@pytest.fixture(scope="module")
def featured_run(prepared, assets, tmp_path_factory):
    train, prior = feature_folders(tmp_path_factory.mktemp("features"), assets["images"])
    spec_path = prepared("--images", str(train), "--prior-images", str(prior), "--caption-dropout", "0.3",
                         "--caption-variants", "2", "--keep-tags", "1", train__steps=STEPS, train__batch_size=2,
                         train__grad_accum=2, train__precision="fp32", data__prior_weight=PRIOR_WEIGHT,
                         data__prior_fraction=0.5, train__eval_quantiles=[0.5])  # evaluation: not the point
    proc = run_trainer(spec_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return spec_path


@pytest.mark.comfyui
def test_a_run_with_caption_dropout_masks_and_prior_images_reports_main_and_prior_loss(featured_run):
    from ingraph_trainer.trainer.run.trust import read_signed_json
    spec = config.load_run_spec(featured_run)
    run_dir = featured_run.parent
    assert spec.data.caption_dropout == 0.3 and spec.data.prior_weight == PRIOR_WEIGHT
    assert Path(spec.data.prior_manifest) == run_dir / "prior_dataset.json"
    assert "prior_dataset.json" in read_signed_json(run_dir / "run.sig")["files"]  # the trainer verifies it
    events = read_events(run_dir)
    started = next(e for e in events if e["type"] == "started")
    assert (started["prior_items"], started["prior_slots"], started["prior_uncovered_buckets"]) == (4, 2, [])
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == STEPS and events[-1]["type"] == "finished"
    for e in steps:
        assert math.isfinite(e["main_loss"]) and math.isfinite(e["prior_loss"])
        # two training and two prior items a step, the prior ones at weight 0.5: the loss is their weighted mean
        assert e["loss"] == pytest.approx((2 * e["main_loss"] + 2 * PRIOR_WEIGHT * e["prior_loss"]) / 4, rel=1e-5)


@pytest.mark.comfyui
def test_a_hand_written_spec_reaches_the_same_batches(featured_run, tmp_path):
    """The spec's [data] fields written by hand, over the run's manifests: the loop's batches are the ones of the
    run the tools wrote, with masks, prior items at their weight and the empty caption in some slots."""
    written = config.load_run_spec(featured_run)
    d, t = written.data, written.train
    by_hand = tmp_path / "run.toml"
    by_hand.write_text(f"""version = {written.version}
run_dir = "{tmp_path}"
[model]
path = "{written.model.path}"
[data]
manifest = "{d.manifest}"
caption_dropout = 0.3
prior_manifest = "{d.prior_manifest}"
prior_weight = {PRIOR_WEIGHT}
prior_fraction = 0.5
[train]
steps = {STEPS}
batch_size = 2
grad_accum = 2
[output]
lora_path = "{tmp_path / 'lora.safetensors'}"
""", encoding="utf-8")
    hand = config.load_run_spec(by_hand)
    assert hand.data == d

    def batches(spec):
        dataset, sampler = mix.build_training_data(spec.data, 4, spec.train.seed)
        return dataset, mix.StepBatches(dataset, sampler, spec.train, spec.data, 1, 0)
    dataset, from_hand = batches(hand)
    _, from_tools = batches(written)
    empty = dataset.main.text_entry(*dataset.main.empty_text)["cond"]
    empties = 0
    for step in range(10):
        ours, theirs = from_hand(step).micro_batches, from_tools(step).micro_batches
        for a, b in zip(ours, theirs, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True) if x is not None)
            if a.mask is None:  # the prior images have no masks: a micro-batch of them alone has none
                assert a.is_prior.all()
            else:  # and weigh 1 everywhere beside masked training images
                trained = a.mask[~a.is_prior]
                assert torch.all(trained[..., 4:] == 0) and torch.all(trained[..., :4] == 1)
                assert torch.all(a.mask[a.is_prior] == 1)
            assert set(a.sample_weight[a.is_prior].tolist()) <= {PRIOR_WEIGHT}
            assert set(a.sample_weight[~a.is_prior].tolist()) <= {1.0}
            empties += sum(torch.equal(c, empty) for c in a.cond)
        assert sum(int(m.is_prior.sum()) for m in ours) == 2
    assert 0 < empties < 40
    assert t.batch_size == hand.train.batch_size


@pytest.mark.comfyui
def test_the_train_node_appends_the_prior_inputs_last_with_tooltips():
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.nodes.train_node import TrainLoRA
    inputs = TrainLoRA.define_schema().inputs
    names = [i.id for i in inputs]
    first = names.index("prior_dataset")  # after the inputs saved workflows already hold
    assert names[first - 1: first + 3] == ["save_ema", "prior_dataset", "prior_weight", "prior_fraction"]
    assert all(i.optional and len(i.tooltip) > 40 for i in inputs[first: first + 3])


def test_the_train_node_refuses_a_prior_set_it_cannot_mix_by_input_name():
    from types import SimpleNamespace
    from ingraph_trainer.runner.train_run import check_prior_dataset
    images = SimpleNamespace(latent_encoder="vae-a", text_encoder="clip-a", caption_dropout=0.3, empty_text=("k", "s"),
                             audio_encoder="")
    check_prior_dataset(images, SimpleNamespace(**vars(images)))
    other_vae = SimpleNamespace(**{**vars(images), "latent_encoder": "vae-b"})
    with pytest.raises(ValueError, match="prior_dataset: its latents were cached with another VAE"):
        check_prior_dataset(images, other_vae)
    no_empty = SimpleNamespace(**{**vars(images), "empty_text": ()})
    with pytest.raises(ValueError, match="prior_dataset: the training images' caption dropout"):
        check_prior_dataset(images, no_empty)


def test_the_start_names_the_training_buckets_no_prior_image_covers():
    from types import SimpleNamespace
    sampler = mix.PriorMixSampler([(64, 64), (64, 64), (96, 64)], [(64, 64)], global_batch=2, seed=0,
                                  prior_fraction=0.5)
    fields, warning = mix.prior_report(SimpleNamespace(prior=SimpleNamespace(unique=[0])), sampler)
    assert fields == {"prior_items": 1, "prior_slots": 1, "prior_uncovered_buckets": [[96, 64]]}
    assert warning.startswith("data.prior_manifest: no prior image has the size of the training bucket(s) 96x64")
    covered = mix.PriorMixSampler([(64, 64)], [(64, 64)], global_batch=2, seed=0, prior_fraction=0.5)
    assert mix.prior_report(SimpleNamespace(prior=SimpleNamespace(unique=[0])), covered)[1] is None
    assert mix.prior_report(None, object()) == ({}, None)  # no prior set: nothing to report


@pytest.mark.comfyui
def test_the_train_node_offers_base_precision_and_hands_it_to_the_spec(monkeypatch):
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.nodes.train_node import TrainLoRA
    from ingraph_trainer.runner import train_run
    from ingraph_trainer.trainer import spec as config
    last = next(i for i in TrainLoRA.define_schema().inputs if i.id == "base_precision")
    assert last.optional and "fp8" in last.tooltip
    assert [config.choice_value(config.BASE_PRECISION_CHOICES, o, "base_precision") for o in last.options] \
        == list(config.BASE_PRECISIONS)
    assert last.default in last.options
    # the runner keeps the draft's base_precision in the model section the hand-off gives, which it hands to
    # prepare_run
    from ingraph_trainer.runner import model_source, node_run, session
    from ingraph_trainer.trainer.graph_model import GraphModel

    class Handed(Exception):
        pass

    def prepare_run(draft, **kwargs):
        raise Handed(draft.model)
    monkeypatch.setattr(model_source, "hand_off_model", lambda *a, **k: types.SimpleNamespace(
        model_spec=config.ModelSpec(path="base.safetensors", weight_dtype="default"), source=None))
    monkeypatch.setattr(model_source, "release_comfy_models", lambda model: None)
    monkeypatch.setattr(GraphModel, "prediction", "epsilon")
    monkeypatch.setattr(train_run, "check_family_settings", lambda *a, **k: None)
    monkeypatch.setattr(train_run, "check_dataset_for_model", lambda *a, **k: None)
    monkeypatch.setattr(session, "prepare_run", prepare_run)
    draft = config.RunSpec(model=config.ModelSpec(base_precision="fp8"))
    node = node_run.NodeCall("Train LoRA", "6", None, on_run=None, check_interrupt=lambda: None)
    with pytest.raises(Handed) as handed:
        node_run.run_task(draft, object(), session.RunDatasets(None), None, node, "base_precision_probe")
    assert handed.value.args[0].base_precision == "fp8" and handed.value.args[0].path == "base.safetensors"


@pytest.mark.comfyui
def test_the_train_node_offers_the_evaluation_inputs_last_and_refuses_a_bad_one_naming_it():
    """Appended last (saved workflows map widget values by position), in the order they came, each default the
    spec's default, and a bad value fails validation naming the input (that a graph's value reaches the run:
    tests/comfyui/test_image_families.py, trained_two_steps; tests/comfyui/test_evaluation.py). Empty quantiles: no evaluation."""
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.nodes.train_node import TrainLoRA
    from ingraph_trainer.runner.evaluation_run import parse_quantiles
    from ingraph_trainer.trainer import spec as config
    *_, last, items, before, after_stop, memory, budget, weight_decay = TrainLoRA.define_schema().inputs
    assert last.id == "eval_quantiles" and last.optional and "forward pass" in last.tooltip
    assert (items.id, before.id, after_stop.id) == ("eval_items", "eval_before", "eval_after_stop")
    # appended after them (issue 30's memory plan), each default the spec's
    assert (memory.id, budget.id) == ("memory", "memory_budget_gb") and memory.optional and budget.optional
    assert (memory.default, budget.default) == (config.TrainSpec().memory, config.TrainSpec().memory_budget_gb) \
        == ("auto", 0.0)
    # then weight_decay (issue 33's input added through the one carrier), the spec's default
    assert weight_decay.id == "weight_decay" and weight_decay.optional
    assert weight_decay.default == config.TrainSpec().weight_decay == 0.01
    spec = config.TrainSpec()
    assert (items.default, before.default, after_stop.default) == \
        (spec.eval_items, spec.eval_before, spec.eval_after_stop) == (8, False, False)
    assert parse_quantiles(last.default) == config.TrainSpec().eval_quantiles == list(config.DEFAULT_EVAL_QUANTILES)
    assert TrainLoRA.validate_inputs("lora", "0.5") is True and TrainLoRA.validate_inputs("lora") is True
    assert TrainLoRA.validate_inputs("lora", "0.5, 1.5") == "eval_quantiles: 1.5 is not between 0 and 1"
    assert TrainLoRA.validate_inputs("lora", " ") is True
