"""DMD2 distillation (task "distill", trainer/tasks/distill.py) as the trainer program runs it, on the tiny SD1.5: 2 processes
under ZeRO-3 match 1 process, a resumed distillation ends bit-identical to an uninterrupted one, and the student's
LoRA loads onto the teacher with ComfyUI's own LoRA code, every key read.

One 1-process run (4 generator updates, a checkpoint at 2) is the reference of all three. Every code path of an
update with one fake score runs in it: the regression warm-up (update 1), the DMD loss with the teacher's
classifier-free guidance on the cached empty caption, backward simulation (a 2-step student), two fake-score
updates and the GAN term. A second run, with a fake score per student step (and no GAN term, which that does not
keep), is resumed too, and refuses to resume with the setting changed."""
from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, read_events, requires_deepspeed, run_trainer

pytestmark = pytest.mark.comfyui

RUN_TIMEOUT = 900  # an update is about 15 forward passes of the three models: minutes on a busy 2-core machine
EMPTY_CAPTION = ("--caption-dropout", "0.1")  # the cache then holds the empty caption's embedding
DISTILL = dict(task="distill", train__batch_size=2, train__precision="fp32", train__learning_rate=1e-3,
               train__seed=5, adapter__rank=4, adapter__alpha=4.0, distill__student_steps=2,
               distill__fake_updates=2, distill__fake_learning_rate=1e-3, distill__gan_weight=0.1,
               distill__regression_steps=1, distill__guidance_scale=1.75)
LOSSES = ("loss", "generator_loss", "fake_loss", "dmd_loss", "regression_loss", "gan_loss")


def runs(run_dir: Path) -> list[list[dict]]:
    """The run folder's events, one list per launch (each begins with its started event)."""
    out: list[list[dict]] = []
    for event in read_events(run_dir):
        if event["type"] == "started":
            out.append([])
        if out:
            out[-1].append(event)
    return out


def steps_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "step"]


@pytest.fixture(scope="module")
def uninterrupted(prepared):
    """1 process, micro-batch 2, 4 generator updates, a checkpoint after update 2; its LoRA kept aside. Its memory
    budget is far too small: the plan warns, and the run goes on as it would without one."""
    spec = prepared(*EMPTY_CAPTION, **DISTILL, train__steps=4, train__save_every=2, train__memory_budget_gb=0.01)
    proc = run_trainer(spec, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shutil.copy(spec.parent / "lora.safetensors", spec.parent / "uninterrupted.safetensors")
    return spec


@pytest.fixture(scope="module")
def uninterrupted_per_step(prepared):
    """The same run with a fake score per student step (distill.fake_score_per_step; the GAN term is not kept with
    it): two fake scores, each with its own engine, optimizer and checkpoint folder."""
    spec = prepared(*EMPTY_CAPTION, **{**DISTILL, "distill__gan_weight": 0.0}, distill__fake_score_per_step=True,
                    train__steps=4, train__save_every=2)
    proc = run_trainer(spec, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shutil.copy(spec.parent / "lora.safetensors", spec.parent / "uninterrupted.safetensors")
    started = runs(spec.parent)[0][0]
    assert started["student_steps"] == 2 and started["fake_trainable_params"] > 0, started
    saved = {p.name for p in spec.parent.rglob("step_000002/fake*") if p.is_dir()}
    assert saved == {"fake", "fake_step2"}, saved  # two fake scores, each in its own folder
    return spec


@requires_deepspeed
def test_two_processes_under_zero3_match_one_process(prepared, uninterrupted):
    spec = prepared(*EMPTY_CAPTION, **{**DISTILL, "train__batch_size": 1}, train__steps=3, distributed__processes=2,
                    distributed__zero_stage=3)
    proc = run_trainer(spec, timeout=RUN_TIMEOUT, processes=2)  # 2 ranks, as the DeepSpeed launcher starts them
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    [two] = runs(spec.parent)
    assert two[0]["task"] == "distill" and two[0]["world_size"] == 2 and two[0]["start_step"] == 0
    # every network partitioned, the frozen teacher too: half the weights on rank 0 (a whole teacher: about 2/3)
    assert two[0]["held_weight_bytes"] < 0.55 * runs(uninterrupted.parent)[0][0]["held_weight_bytes"], two[0]
    one = steps_of(runs(uninterrupted.parent)[0])[:3]
    two = steps_of(two)
    assert len(two) == 3 and len(one) == 3
    assert "regression_loss" in one[0] and all("dmd_loss" in e and "gan_loss" in e for e in one[1:]), one
    for a, b in zip(one, two):
        for name in ("generator_loss", "fake_loss"):
            assert abs(a[name] - b[name]) < 1e-5, (name, a["step"], a[name], b[name])
        assert a["loss"] == a["generator_loss"]  # the panel's loss is the generator's


@pytest.mark.parametrize("reference", ["uninterrupted", "uninterrupted_per_step"])
def test_resumed_distillation_ends_bit_identical(reference, request):
    """Resumed from the checkpoint of update 2 (every engine, the GAN head or the second fake score, the step), in
    a new process, to update 4: the same losses and the same LoRA, to the bit."""
    uninterrupted = request.getfixturevalue(reference)
    run_dir = uninterrupted.parent
    proc = run_trainer(uninterrupted, "--resume", "step_000002", timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, resumed = runs(run_dir)[:2]
    assert resumed[0]["start_step"] == 2
    expected, got = steps_of(first)[2:], steps_of(resumed)
    assert [e["step"] for e in got] == [e["step"] for e in expected] == [3, 4]
    for a, b in zip(expected, got):
        assert {k: a.get(k) for k in LOSSES} == {k: b.get(k) for k in LOSSES}, (a, b)
    reference, result = load_file(run_dir / "uninterrupted.safetensors"), load_file(run_dir / "lora.safetensors")
    assert reference.keys() == result.keys()
    for key in reference:
        assert torch.equal(reference[key], result[key]), key


def test_the_memory_plan_counts_every_network_and_warns_beyond_the_budget(uninterrupted, uninterrupted_per_step):
    """The plan (made before the fake scores and the teacher load) counts each network: a fake score per student
    step is two fake scores' weights and training state, and the GAN term the fake score's activations too."""
    events = read_events(uninterrupted.parent)
    first_start = next(i for i, e in enumerate(events) if e["type"] == "started")
    plan, per_step = events[first_start]["memory_plan"]["parts"], \
        runs(uninterrupted_per_step.parent)[0][0]["memory_plan"]["parts"]
    assert plan["activations"] > 0 and plan["teacher"] > 0
    assert plan["fake scores"] > plan["teacher"]  # the teacher's frozen weights, and the adapter's training state
    assert per_step["fake scores"] == 2 * plan["fake scores"] and per_step["teacher"] == plan["teacher"]
    assert plan["fake score activations (GAN)"] == plan["activations"] and "fake score activations (GAN)" not in per_step
    # the first launch's own warning: logged while it builds, before its started event
    warnings = [e["message"] for e in events[:first_start] if e["type"] == "log" and e["level"] == "warning"]
    assert any(m.startswith("the memory plan predicts that the distillation (1 fake score and the teacher beside "
                            "the student) needs ") and "0.0 GiB may be used (memory_budget_gb)" in m
               for m in warnings), warnings


def test_resuming_with_fake_score_per_step_changed_is_refused_naming_it(uninterrupted_per_step):
    """A checkpoint of 2 fake scores resumed as a run of one: refused before any update, naming the setting."""
    text = uninterrupted_per_step.read_text()
    assert "fake_score_per_step = true" in text
    changed = uninterrupted_per_step.with_name("one_fake_score.toml")
    changed.write_text(text.replace("fake_score_per_step = true", "fake_score_per_step = false"))
    proc = run_trainer(changed, "--resume", "step_000002", timeout=RUN_TIMEOUT)
    assert proc.returncode != 0
    assert "fake_score_per_step" in proc.stderr + proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])


def test_student_lora_loads_onto_the_teacher_in_comfyui(uninterrupted, assets, caplog):
    """What LoraLoaderModelOnly runs (comfy.sd.load_lora_for_models) on the teacher's checkpoint: no "lora key not
    loaded", one patch for each adapted layer, and the update is not zero."""
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import comfy.sd
    tensors = load_file(uninterrupted.parent / "uninterrupted.safetensors")
    layers = {k[:-len(".lora_down.weight")] for k in tensors if k.endswith(".lora_down.weight")}
    assert layers and all(k.startswith("diffusion_model.") for k in tensors)
    assert all(tensors[f"{layer}.lora_up.weight"].abs().max() > 0 for layer in layers)
    teacher = comfy.sd.load_checkpoint_guess_config(str(assets["checkpoint"]), output_vae=False, output_clip=False,
                                                    output_clipvision=False)[0]
    with caplog.at_level(logging.WARNING):
        patched, _ = comfy.sd.load_lora_for_models(teacher, None, tensors, 1.0, 0.0)
    assert "lora key not loaded" not in caplog.text, caplog.text[-2000:]
    assert set(patched.patches) == {f"{layer}.weight" for layer in layers}
