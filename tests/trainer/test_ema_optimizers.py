"""EMA of the trained weights and the optimizers beside AdamW (issue 14): the layouts each may run under, lazy
imports, the EMA's arithmetic and swap, schedule-free's averaged weights; and one trainer program that trains every
optimizer 3 steps and resumes each bit-identically, the EMA included, whose EMA file ComfyUI loads whole."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from conftest import REPO, requires_deepspeed

from ingraph_trainer.trainer import spec as config
from ingraph_trainer.trainer.spec import (DataSpec, DistributedSpec, ModelSpec, OutputSpec, RunSpec, RunSpecError,
                                            TrainSpec)

# every optimizer record but the first two (their own tests): one added to trainer/optim.py is run here as it is
# (ademamix was added so, issue 33)
NEW_OPTIMIZERS = [o.value for o in config.OPTIMIZER_CHOICES if o.value not in ("adamw", "adamw8bit")]
LIBRARIES = {o.value: o.library for o in config.OPTIMIZER_CHOICES if o.value != "adamw"}


def spec_with(optimizer="adamw", precision="fp32", zero_stage=0, processes=1, pipeline_stages=1, **train) -> RunSpec:
    return RunSpec(run_dir="run", model=ModelSpec(path="m.safetensors"), data=DataSpec(manifest="d.json"),
                   output=OutputSpec(lora_path="out.safetensors"),
                   train=TrainSpec(optimizer=optimizer, precision=precision, **train),
                   distributed=DistributedSpec(processes=processes, zero_stage=zero_stage,
                                               pipeline_stages=pipeline_stages))


@pytest.mark.parametrize("optimizer,precision,zero_stage,stages,refused", [
    ("adafactor", "fp32", 0, 1, False), ("adafactor", "bf16", 0, 1, True), ("adafactor", "fp32", 1, 1, True),
    ("came", "fp32", 2, 1, True), ("came", "bf16", 0, 1, True), ("came", "fp32", 0, 1, False),
    ("prodigy", "bf16", 0, 1, True), ("prodigy", "fp32", 0, 1, False), ("prodigy", "fp32", 1, 1, True), ("prodigy", "fp32", 0, 2, True),
    ("adamw_schedulefree", "fp32", 0, 1, False), ("adamw_schedulefree", "bf16", 0, 1, True),
    ("adamw_schedulefree", "fp32", 3, 1, True),
    ("lion", "bf16", 3, 1, False), ("adamw", "bf16", 2, 1, False), ("adamw8bit", "bf16", 1, 1, False),
])
@requires_deepspeed  # the layouts are two processes' (the rule for a missing DeepSpeed: tests/unit/test_unit.py)
def test_optimizers_are_refused_where_deepspeed_would_make_them_train_differently(optimizer, precision, zero_stage,
                                                                                  stages, refused):
    spec = spec_with(optimizer, precision, zero_stage, processes=2, pipeline_stages=stages)
    if not refused:
        spec.validate()
        return
    with pytest.raises(RunSpecError, match=r"train\.optimizer: .*distributed\.(zero_stage|pipeline_stages)") as err:
        spec.validate()
    assert optimizer in str(err.value) and f"zero_stage {zero_stage}" in str(err.value)


def test_a_factored_optimizer_trains_factored_in_bf16_in_one_process(prepared):
    """One process trains without DeepSpeed: its fp32 master copies keep each weight's shape, so Adafactor keeps
    its row and column factors in bf16 too (refused there while DeepSpeed flattened them); ZeRO still refuses it."""
    from conftest import run_trainer
    spec_with("adafactor", "bf16").validate()
    with pytest.raises(RunSpecError, match=r"train\.optimizer: adafactor"):
        spec_with("adafactor", "bf16", zero_stage=1).validate()
    spec = prepared(train__optimizer="adafactor", train__precision="bf16", train__steps=2, train__save_every=1,
                    train__eval_quantiles=[0.5], train__learning_rate=1e-3)
    proc = run_trainer(spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(spec.parent / "checkpoints" / "step_000001" / "plain_engine.pt", weights_only=True)
    per_param = list(state["optimizer"]["state"].values())
    assert per_param and any("exp_avg_sq_row" in s for s in per_param)  # 2-D LoRA weights, factored
    assert all(t.dtype == torch.float32 for t in state["masters"])


@requires_deepspeed
def test_ema_is_refused_where_processes_hold_slices_of_the_weights():
    for kwargs, message in (({"zero_stage": 3}, r"train\.ema_decay: ZeRO-3 \(distributed\.zero_stage 3\)"),
                            ({"pipeline_stages": 2}, r"train\.ema_decay: pipeline stages")):
        with pytest.raises(RunSpecError, match=message):
            spec_with(processes=2, ema_decay=0.9, **kwargs).validate()
        spec_with(processes=2, **kwargs).validate()  # without EMA the layout is fine
    spec = spec_with(ema_decay=0.0)
    spec.output.weights = "ema"
    with pytest.raises(RunSpecError, match=r"output\.weights: 'ema' needs .*train\.ema_decay"):
        spec.validate()
    with pytest.raises(RunSpecError, match=r"train\.ema_decay: must be in \[0, 1\)"):
        spec_with(ema_decay=1.0).validate()


def test_every_optimizer_has_a_label_and_the_node_lists_them_with_the_ema_inputs_last():
    assert config.choice_labels(config.OPTIMIZER_CHOICES)[:2] == ["AdamW", "AdamW 8-bit"]  # saved workflows
    assert set(NEW_OPTIMIZERS) <= set(config.OPTIMIZERS)
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.nodes.train_node import TrainLoRA
    inputs = TrainLoRA.define_schema().inputs
    by_name = {i.id: i for i in inputs}
    assert by_name["optimizer"].options == config.choice_labels(config.OPTIMIZER_CHOICES)
    assert [config.choice_value(config.OPTIMIZER_CHOICES, label, "optimizer") for label in by_name["optimizer"].options] \
        == list(config.OPTIMIZERS)
    assert "Prodigy: prodigyopt" in by_name["optimizer"].tooltip
    ema = [i.id for i in inputs].index("ema_decay")  # appended after the inputs saved workflows already hold
    assert [i.id for i in inputs[ema - 1: ema + 3]] == ["keep_last", "ema_decay", "ema_start_step", "save_ema"]
    assert all(i.optional and i.tooltip for i in inputs[ema: ema + 3])


def test_each_optimizer_imports_only_its_own_library():
    program = f"""
import sys
sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / 'tests')!r})
import conftest, torch
from ingraph_trainer.trainer.spec import RunSpec
from ingraph_trainer.trainer.optim import build_optimizer
libraries = {LIBRARIES!r}
spec = RunSpec()
for optimizer in ["adamw", *{NEW_OPTIMIZERS!r}]:
    spec.train.optimizer = optimizer
    build_optimizer(spec, [torch.nn.Parameter(torch.ones(2, 2))])
    loaded = {{name for name in set(libraries.values()) if name in sys.modules}}
    print(optimizer, sorted(loaded))
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert loaded["adamw"] == "[]"  # nothing optional for the default
    assert loaded["prodigy"] == "['prodigyopt']"
    assert loaded["adafactor"] == "['prodigyopt', 'pytorch_optimizer']"
    assert "schedulefree" not in loaded["lion"] and "schedulefree" in loaded["adamw_schedulefree"]


def test_weight_average_follows_its_decay_from_the_start_step_and_swaps_in_exactly():
    from ingraph_trainer.trainer.ema import WeightAverage, exported_weights
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.bfloat16))
    average = WeightAverage([weight], decay=0.75, start_step=2)
    assert average.average[0].dtype == torch.float32
    expected = weight.detach().float().clone()
    for step in range(1, 6):
        with torch.no_grad():
            weight.add_(torch.randn_like(weight))
        average.update(step)
        expected = weight.detach().float().clone() if step <= 2 else 0.75 * expected + 0.25 * weight.detach().float()
        torch.testing.assert_close(average.average[0], expected, rtol=1e-6, atol=1e-6)
    trained = weight.detach().clone()
    with average.swapped_in():
        assert torch.equal(weight.detach(), average.average[0].to(torch.bfloat16))
    assert torch.equal(weight.detach(), trained)  # bit for bit
    spec = spec_with(ema_decay=0.75)
    spec.output.weights = "ema"
    with exported_weights(spec, average):
        assert not torch.equal(weight.detach(), trained)
    spec.output.weights = "trained"
    with exported_weights(spec, average):
        assert torch.equal(weight.detach(), trained)

    other = WeightAverage([torch.nn.Parameter(torch.zeros(3, 4))], decay=0.75, start_step=2)
    other.load_state_dict(average.state_dict(), "checkpoint x")
    assert torch.equal(other.average[0], average.average[0])
    with pytest.raises(ValueError, match="checkpoint x: its EMA does not match"):
        WeightAverage([torch.nn.Parameter(torch.zeros(2))], 0.5, 0).load_state_dict(average.state_dict(), "checkpoint x")


def test_schedule_free_evaluates_its_averaged_weights_and_trains_on_exactly_where_it_was():
    from ingraph_trainer.trainer.optim import averaged_weights, build_optimizer
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = build_optimizer(spec_with("adamw_schedulefree", learning_rate=0.1), [weight])
    for _ in range(3):
        (weight ** 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = weight.detach().clone()
    beta1 = optimizer.param_groups[0]["betas"][0]
    z = optimizer.state[weight]["z"]
    x = trained + (1 - 1 / beta1) * (z - trained)  # schedulefree's eval(): y lerped towards z
    with averaged_weights(optimizer):
        torch.testing.assert_close(weight.detach(), x)
        assert not torch.equal(weight.detach(), trained)
    assert torch.equal(weight.detach(), trained) and optimizer.param_groups[0]["train_mode"]
    adamw_weight = torch.nn.Parameter(trained.clone())
    with averaged_weights(build_optimizer(spec_with("adamw"), [adamw_weight])):
        assert torch.equal(adamw_weight.detach(), trained)


@pytest.fixture(scope="module")
def optimizer_runs(prepared, tmp_path_factory):
    """Every optimizer, 3 steps with a checkpoint at step 2 then resumed from it, in one trainer program
    (tests/helpers/optimizer_runs.py: the trainer's own Trainer in-process); AdamW keeps an EMA and saves it."""
    # rank 16: tensors of 16 x 320 elements and more, where bitsandbytes keeps 8-bit state (below 4096 elements it
    # keeps 32-bit state, which with bitsandbytes 0.50.2 is AdamW to the bit)
    base = prepared(train__precision="fp32", train__batch_size=2, train__seed=5, adapter__rank=16,
                    adapter__dropout=0.1, train__eval_quantiles=[0.5])
    from conftest import run_forked_program
    runs = ["adamw", "adamw:ema", "adamw8bit", *NEW_OPTIMIZERS]
    out = run_forked_program("optimizer_runs", [base, tmp_path_factory.mktemp("optimizers"), *runs], base.parent,
                             timeout=900)  # a child of the session's trainer worker: its imports paid once
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _of(events, kind):
    return [e for e in events if e["type"] == kind]


@pytest.mark.comfyui
def test_each_optimizer_trains_3_steps_and_resumes_bit_identically(optimizer_runs):
    assert set(optimizer_runs) == {"adamw", "adamw:ema", "adamw8bit", *NEW_OPTIMIZERS}
    losses = {}
    for run, result in optimizer_runs.items():
        first, resumed = result["first"], result["resumed"]
        assert not _of(first, "error") and not _of(resumed, "error"), (run, _of(first + resumed, "error"))
        assert [e["step"] for e in _of(first, "step")] == [1, 2, 3], run
        assert [e["step"] for e in _of(first, "checkpoint")] == [2], run
        assert _of(resumed, "started")[0]["start_step"] == 2 and [e["step"] for e in _of(resumed, "step")] == [3]
        assert _of(resumed, "step")[0]["loss"] == _of(first, "step")[2]["loss"], run
        assert _of(resumed, "eval")[-1]["loss"] == _of(first, "eval")[-1]["loss"], run
        assert result["resumed_file"] == result["first_file"], f"{run}: the resumed adapter differs"
        losses[run] = [e["loss"] for e in _of(first, "step")]
    assert losses.pop("adamw:ema") == losses["adamw"]  # keeping an EMA leaves training alone
    # every optimizer trains its own way (the same first step: the same weights and batch)
    assert len({tuple(v[1:]) for v in losses.values()}) == len(losses), losses


@pytest.mark.comfyui
def test_ema_resumes_bit_identically_is_evaluated_and_its_file_loads_in_comfyui(optimizer_runs, assets, caplog):
    result = optimizer_runs["adamw:ema"]
    first_eval, resumed_eval = _of(result["first"], "eval")[-1], _of(result["resumed"], "eval")[-1]
    assert resumed_eval["ema_loss"] == first_eval["ema_loss"]  # the resumed average is the uninterrupted one
    assert first_eval["ema_loss"] != first_eval["loss"]  # the average, not the last weights, was evaluated
    assert _of(result["first"], "eval")[0]["ema_loss"] == _of(result["first"], "eval")[0]["loss"]  # step 0: equal
    # the saved file is the EMA, not the weights the same training (the adamw run) ended with
    trained = optimizer_runs["adamw"]
    assert result["first_file"] != trained["first_file"]
    from safetensors.torch import load_file
    assert set(load_file(result["lora_path"])) == set(load_file(trained["lora_path"]))

    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.sd
    import comfy.utils
    model = comfy.sd.load_checkpoint_guess_config(str(assets["checkpoint"]), output_vae=False,
                                                  output_clip=False)[0]
    lora = comfy.utils.load_torch_file(result["lora_path"], safe_load=True)
    with caplog.at_level(logging.WARNING):
        patched = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()], caplog.text
    assert len(patched.patches) == _of(result["first"], "started")[0]["adapted_modules"] > 0
