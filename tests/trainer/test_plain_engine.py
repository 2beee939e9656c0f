"""One process trains in plain PyTorch (trainer/parallel/plain_engine.py), with DeepSpeed's numbers and without DeepSpeed.

The comparison runs take DeepSpeed's engine through INGRAPH_TRAINER_ENGINE=deepspeed (what one-process runs used
before); both are the trainer program on the same spec. "Bit for bit" holds on a CPU. On a GPU, two fp32 runs of the
same spec already differ (attention's backward adds in any order; seen on an H200: 3e-5 relative by step 2, while bf16
runs repeated exactly), so there the comparisons hold to GPU_RTOL, far below what a lost generator or optimizer state
changes (1e-2 and more)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, read_events, requires_deepspeed, run_trainer
from ingraph_trainer.trainer.spec import deepspeed_installed

pytestmark = pytest.mark.comfyui
ON_GPU = torch.cuda.is_available()  # the trainer's children compute on it (asked through NVML: no context here)
GPU_RTOL = 2e-4
GPU_TENSOR_RTOL = 1e-2


def same_numbers(a: list, b: list) -> bool:
    """Equal on a CPU; within GPU_RTOL of each other on a GPU (see above)."""
    if not ON_GPU:
        return a == b
    return len(a) == len(b) and all((x is None and y is None) or abs(x - y) <= GPU_RTOL * abs(y) for x, y in zip(a, b))


def same_tensors(a: dict, b: dict) -> bool:
    """Equal on a CPU. On a GPU each tensor's difference is held to GPU_TENSOR_RTOL of its norm, not element by
    element: Adam divides each element's step by its own gradient's size, so an element whose gradient is near zero
    moves by up to the learning rate either way on the kernels' noise (an H200 failed elementwise allclose while
    the losses and gradient norms held to 2e-4)."""
    if not ON_GPU:
        return all(torch.equal(a[k], b[k]) for k in b)
    return all(float((a[k].float() - b[k].float()).norm()) <= GPU_TENSOR_RTOL * float(b[k].float().norm()) + 1e-12
               for k in b)

# the fixed 5-step fp32 run: accumulation 2 (the loss scaling and the boundary), clipping on (the default 1.0,
# and low enough here to clip), a warm-up and a linear schedule (the scheduler's steps), a checkpoint at step 2
FIXED_FP32 = dict(train__steps=5, train__batch_size=2, train__grad_accum=2, train__precision="fp32", train__seed=3,
                  train__lr_schedule="linear", train__warmup_steps=1, train__save_every=2, train__max_grad_norm=0.05,
                  train__eval_quantiles=[0.5], train__learning_rate=1e-3, train__eval_before=True)


def trained(spec, engine: str):
    env = {"INGRAPH_TRAINER_ENGINE": "deepspeed"} if engine == "deepspeed" else None
    proc = run_trainer(spec, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = read_events(spec.parent)
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == 5 and events[-1]["type"] == "finished"
    return steps, load_file(spec.parent / "lora.safetensors"), events


@pytest.fixture(scope="module")
def fp32_pair(prepared):
    """The fixed run on the plain engine, and on DeepSpeed's where it is installed."""
    return {engine: trained(prepared(**FIXED_FP32), engine)
            for engine in ("plain", "deepspeed") if engine == "plain" or deepspeed_installed()}


@requires_deepspeed
def test_fp32_one_process_run_is_bit_identical_to_deepspeeds_engine(fp32_pair):
    (plain, plain_lora, plain_events), (ds, ds_lora, _) = fp32_pair["plain"], fp32_pair["deepspeed"]
    assert same_numbers([s["loss"] for s in plain], [s["loss"] for s in ds])
    assert same_numbers([s["grad_norm"] for s in plain], [s["grad_norm"] for s in ds])
    assert [s["lr"] for s in plain] == [s["lr"] for s in ds]
    assert max(s["grad_norm"] for s in plain) > FIXED_FP32["train__max_grad_norm"]  # clipping took part
    assert plain_lora.keys() == ds_lora.keys() and plain_lora
    assert same_tensors(plain_lora, ds_lora)
    finished = plain_events[-1]
    assert same_numbers([finished["eval_after"]], [fp32_pair["deepspeed"][2][-1]["eval_after"]])


@pytest.fixture(scope="module")
def bf16_run(prepared):
    return trained(prepared(**dict(FIXED_FP32, train__precision="bf16")), "plain")


def test_bf16_one_process_run_follows_the_fp32_run(bf16_run, fp32_pair):
    """bf16: the weights computed in bf16, the optimizer on fp32 master copies, so the run follows the fp32 one.
    (DeepSpeed's bf16 engine strays further, 2-3 % by step 3: at start-up its optimizer wrapper takes one AdamW step
    on zero gradients, which decays the weights and advances Adam's bias correction; this engine does not.)"""
    plain, lora, events = bf16_run
    fp32, _, fp32_events = fp32_pair["plain"]
    assert [s["loss"] for s in plain] != [s["loss"] for s in fp32]  # computed in bf16 indeed
    for a, b in zip(plain, fp32, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 5e-3 * b["loss"], (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-2 * b["grad_norm"], (a["grad_norm"], b["grad_norm"])
    assert abs(events[-1]["eval_after"] - fp32_events[-1]["eval_after"]) <= 5e-3 * fp32_events[-1]["eval_after"]
    assert events[-1]["eval_after"] < events[-1]["eval_before"]


def test_fp16_overflowing_steps_are_skipped_and_the_run_goes_on(prepared):
    """fp16 with its dynamic loss scale. Started at 2^22 the scaled gradients overflow fp16: such a step is skipped
    (no gradient norm, no weight or schedule change) and the scale halves until steps apply; the run is not stopped
    as diverged, and it learns. (fp16 computes ~30x slower than fp32 on this CPU, so 3 steps; a probe of the fixed
    run in fp16 from 2^16 followed the fp32 run's losses to 1e-4.)"""
    spec = prepared(**dict(FIXED_FP32, train__precision="fp16", train__steps=3, train__save_every=0,
                           train__lr_schedule="constant", train__warmup_steps=0))
    proc = run_trainer(spec, patch="huge_loss_scale", env={"INGRAPH_LOSS_SCALE_POWER": "22"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_events(spec.parent)
    norms = [e["grad_norm"] for e in events if e["type"] == "step"]
    assert len(norms) == 3 and events[-1]["type"] == "finished"
    skipped = norms.index(next(n for n in norms if n is not None))
    assert skipped >= 1 and all(n is None for n in norms[:skipped])  # overflowed, then applied
    assert sum(n is not None for n in norms) >= 1
    assert events[-1]["eval_after"] < events[-1]["eval_before"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stop_then_resume_on_the_plain_engine_matches_uninterrupted(prepared, fp32_pair, bf16_run, precision):
    """The plain engine's own checkpoint (weights, their fp32 masters in bf16, optimizer, scheduler, step counts,
    random state) resumes exactly."""
    uninterrupted = fp32_pair["plain"] if precision == "fp32" else bf16_run
    spec = prepared(**dict(FIXED_FP32, train__precision=precision))
    killed_at_step_2_then_resumed(spec, "plain_engine.pt")
    assert_same_run(spec, uninterrupted)


def killed_at_step_2_then_resumed(spec, checkpoint_file: str, env: dict | None = None):
    """The run killed once its step-2 checkpoint (holding `checkpoint_file`) is written, then resumed (`env`: the
    first run's variables)."""
    first = run_trainer(spec, kill_on="checkpoint", env=env)
    assert first.returncode != 0
    saved = sorted((spec.parent / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == ["step_000002"] and (saved[0] / checkpoint_file).is_file()
    proc = run_trainer(spec, "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["start_step"] for e in read_events(spec.parent) if e["type"] == "started"][-1] == 2


def assert_same_run(spec, uninterrupted):
    """The run's step losses (the resumed part appended to the first) and adapter are the uninterrupted run's."""
    resumed = {e["step"]: e["loss"] for e in read_events(spec.parent) if e["type"] == "step"}
    reference = {s["step"]: s["loss"] for s in uninterrupted[0]}
    assert resumed.keys() == reference.keys() and same_numbers(list(resumed.values()), list(reference.values()))
    assert same_tensors(load_file(spec.parent / "lora.safetensors"), uninterrupted[1])


def test_a_one_process_run_imports_no_deepspeed(prepared):
    """The trainer program itself, in a fresh process: Python's import log names every module it imported."""
    spec = prepared(**dict(FIXED_FP32, train__steps=2, train__save_every=1, train__precision="auto"))
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "trainer"), "--config", str(spec)],
                          capture_output=True, text=True, timeout=300, cwd=spec.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "torch" in imported and "peft" in imported  # the log is the run's: its heavy imports are there
    events = read_events(spec.parent)
    assert events[-1]["type"] == "finished"
    assert events[0]["precision"] == "bf16"  # "auto" on a CPU, decided by the trainer
    assert not [m for m in imported if m.split(".")[0] == "deepspeed"]


@requires_deepspeed
def test_a_run_checkpointed_by_deepspeeds_engine_resumes_on_the_plain_engine(prepared, fp32_pair):
    """A one-process run started before this engine (DeepSpeed's files in its checkpoint) resumes on it, bit for bit
    the run the plain engine trains uninterrupted."""
    spec = prepared(**FIXED_FP32)
    killed_at_step_2_then_resumed(spec, "mp_rank_00_model_states.pt", env={"INGRAPH_TRAINER_ENGINE": "deepspeed"})
    assert_same_run(spec, fp32_pair["plain"])
