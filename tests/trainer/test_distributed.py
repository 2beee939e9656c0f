"""DeepSpeed layouts on CPU over gloo: parity of data parallel and ZeRO stages, resume, several machines."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, evaluate_on_one_image, read_events, requires_deepspeed, run_trainer
from waiting import wait_until

pytestmark = [pytest.mark.comfyui, requires_deepspeed]

TRAINER = str(REPO / "trainer" / "__main__.py")
COMMON = dict(train__steps=5, train__batch_size=2, train__precision="fp32", train__seed=3,
              train__lr_schedule="linear", train__warmup_steps=1, train__save_every=2,
              train__eval_quantiles=[0.5], train__learning_rate=1e-3, train__eval_before=True)
BF16_LOSS_TOLERANCE = 1e-2  # bf16 against fp32 on the tiny model; a wrongly filled weight is off by far more


@pytest.fixture(scope="module")
def biased_checkpoint(assets, tmp_path_factory) -> Path:
    """The suite's tiny checkpoint with its diffusion model's biases drawn at random (its own are zeros, as the
    random-weight builders make them): a layout that fills a bias wrongly or not at all (ZeRO-3's partitioned load
    copies each process's slice of every weight from the file) then changes the numbers."""
    from safetensors.torch import save_file
    generator = torch.Generator().manual_seed(11)
    state = load_file(str(assets["checkpoint"]))
    for key, value in state.items():
        if key.startswith("model.diffusion_model.") and key.endswith(".bias"):
            state[key] = (torch.randn(value.shape, generator=generator) * 0.05).to(value.dtype)
    path = tmp_path_factory.mktemp("biased") / "tiny_sd15_biased.safetensors"
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def prepared(prepared, biased_checkpoint):
    """conftest's run specs, on the checkpoint with random biases unless a test names its own model."""
    def make_run(*flags, **overrides) -> Path:
        if "model__path" not in overrides:
            overrides.update(model__path=str(biased_checkpoint), model__stamps=[])
        return prepared(*flags, **overrides)
    return make_run


def launch(spec: Path, processes: int, *extra, timeout=300) -> subprocess.CompletedProcess:
    """The ranks forked from conftest's trainer worker with the DeepSpeed launcher's variables (its imports paid once,
    not once a rank and twice more by the launcher's own processes: ~15 s a run on 2 cores). The launcher itself
    starts the first run of test_two_process_stop_then_resume_matches_uninterrupted and the runs from ComfyUI;
    torchrun, those of test_two_machines_over_loopback_match_one_machine."""
    proc = run_trainer(spec, *extra, timeout=timeout, processes=processes)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc


def step_losses(run_dir: Path) -> list[float]:
    return [e["loss"] for e in read_events(run_dir) if e["type"] == "step"]


def adapters_agree(a: Path, b: Path):
    """Layouts sum in different orders and Adam magnifies that on near-zero gradients, so adapters are
    compared by what they do: the final fixed-noise evaluation loss. Exactness is for same-layout resume."""
    ea = [e for e in read_events(a) if e["type"] == "finished"][-1]["eval_after"]
    eb = [e for e in read_events(b) if e["type"] == "finished"][-1]["eval_after"]
    assert abs(ea - eb) < 1e-4, (ea, eb)
    ta, tb = load_file(a / "lora.safetensors"), load_file(b / "lora.safetensors")
    assert {k: tuple(v.shape) for k, v in ta.items()} == {k: tuple(v.shape) for k, v in tb.items()}
    assert all(v.numel() > 0 for v in tb.values())


FULL_FINE_TUNE = dict(train__steps=3, train__batch_size=2, train__precision="fp32", train__learning_rate=1e-4,
                      train__eval_quantiles=[0.5], adapter__kind="full", train__eval_before=True)


@pytest.fixture(scope="module")
def one_process_runs(prepared):
    """The 1-process runs that layouts are compared with, trained in one batch (tests/helpers/train_forked.py: each run its
    own process, the imports shared): "reference" (micro-batch 2, gradient accumulation 2: the layout every other
    run must match), "block_swap" (the same, 3 blocks swapped, gradient checkpointing; "block_swap_zero1" under
    DeepSpeed's engine, ZeRO-1, whose start leaves the swapped weights in host memory), "full" (a full fine-tune,
    accumulation 2) and "evaluate" (the evaluate task)."""
    from conftest import run_trainers_forked
    specs = {"reference": prepared(**COMMON, train__grad_accum=2),
             "block_swap": prepared(**COMMON, train__grad_accum=2, distributed__block_swap=3,
                                    train__gradient_checkpointing=True),
             "block_swap_zero1": prepared(**COMMON, train__grad_accum=2, distributed__block_swap=3,
                                          train__gradient_checkpointing=True, distributed__zero_stage=1),
             "full": prepared(**FULL_FINE_TUNE, train__grad_accum=2),
             "evaluate": prepared(task="evaluate", train__precision="fp32", train__batch_size=3)}
    proc = run_trainers_forked(*specs.values())

    def finished(name: str) -> Path:
        assert proc.statuses.get(specs[name]) == 0, f"{name}: {proc.statuses}\n{proc.stderr[-3000:]}"
        return specs[name]
    return finished


@pytest.fixture(scope="module")
def reference(one_process_runs):
    """1 process, micro-batch 2, gradient accumulation 2: the layout every other run must match."""
    return one_process_runs("reference").parent


@pytest.fixture(scope="module")
def two_process_zero0(prepared):
    spec = prepared(**COMMON, distributed__processes=2)
    launch(spec, 2)
    return spec.parent


def test_two_processes_match_one_process_with_accumulation(reference, two_process_zero0):
    ref, dp = step_losses(reference), step_losses(two_process_zero0)
    assert len(ref) == len(dp) == 5
    assert max(abs(a - b) for a, b in zip(ref, dp)) < 1e-5, (ref, dp)
    adapters_agree(reference, two_process_zero0)
    started = read_events(two_process_zero0)[0]
    assert started["world_size"] == 2
    # only rank 0 writes events: one started and one finished event
    kinds = [e["type"] for e in read_events(two_process_zero0)]
    assert kinds.count("started") == 1 and kinds.count("finished") == 1


# stage 1: test_two_machines_over_loopback_match_one_machine; stage 3 alone: its stop and resume below
@pytest.mark.parametrize("stage", [2, "3 offload", "3 bf16"])
def test_zero_stages_match_zero_0(prepared, two_process_zero0, stage):
    """Stage 3 loads its weights straight into partitions; "3 offload" also keeps them in host memory; "3 bf16" fills
    bf16 partitions from the fp32 file (ZeRO-0 in fp32 is the reference: to bf16's precision)."""
    settings = {"3 offload": {"distributed__offload_params": True}, "3 bf16": {"train__precision": "bf16"}}
    offload, bf16 = stage == "3 offload", stage == "3 bf16"
    spec = prepared(**{**COMMON, **settings.get(stage, {})}, distributed__processes=2,
                    distributed__zero_stage=3 if isinstance(stage, str) else stage)
    stage = 3 if isinstance(stage, str) else stage
    launch(spec, 2)
    ref, got = step_losses(two_process_zero0), step_losses(spec.parent)
    assert len(ref) == len(got) == 5  # the same steps, all of them, before they are compared
    assert max(abs(a - b) for a, b in zip(ref, got)) < (BF16_LOSS_TOLERANCE if bf16 else 1e-5), (stage, ref, got)
    if not bf16:
        adapters_agree(two_process_zero0, spec.parent)
    if stage == 3:  # the weights went straight into each process's partitions (the memory: the test below)
        started = read_events(spec.parent)[0]
        assert started["load_memory"].get("partitioned") is True
        assert (started["memory_plan"]["host_parts"].get("offloaded weights", 0) > 0) == bool(offload)


def test_two_process_stop_then_resume_matches_uninterrupted(prepared, two_process_zero0):
    """Rank 0 reads STOP and both ranks follow it: the same step saved, exit 0. Under ZeRO-3, so both launches load
    their weights into partitions (none offloaded) and the resume reads each process's partition of the checkpoint;
    the steps before and after the stop follow ZeRO-0's uninterrupted run to 1e-5 (the layouts' parity bound, as the
    other stages' above: a resume a batch or a noise draw off is off by far more). One stop and resume, not one per
    stage (suite time): ZeRO-0's resume reads the same sampler and random state, and a one-process resume is held
    to the bit (test_plain_engine, test_trainer_program)."""
    from ingraph_trainer.runner.launcher import deepspeed_launch_command
    spec = prepared(**COMMON, distributed__processes=2, distributed__zero_stage=3)
    run_dir = spec.parent
    proc = subprocess.Popen([*deepspeed_launch_command(sys.executable, 2), TRAINER, "--config", str(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=run_dir)
    try:
        deadline = time.monotonic() + 240
        while not any(e["type"] == "started" for e in read_events(run_dir)):
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not start"
            time.sleep(0.05)
        (run_dir / "STOP").write_text("stop requested\n")  # before step 1 ends: the stop lands on step 1
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, out[-4000:]
    finished = [e for e in read_events(run_dir) if e["type"] == "finished"]
    assert len(finished) == 1 and finished[0]["stopped"] is True and finished[0]["steps"] == 1
    # (ZeRO-3's checkpoints come with DeepSpeed's scripts that gather the partitions: zero_to_fp32.py)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()) == ["step_000001"]
    assert not (run_dir / "STOP").exists()  # honoured once: the resumed run trains to its end
    launch(spec, 2, "--resume", "latest")
    started = [e for e in read_events(run_dir) if e["type"] == "started"]
    assert len(started) == 2 and started[-1]["start_step"] == 1
    finished = [e for e in read_events(run_dir) if e["type"] == "finished"]
    assert finished[-1]["stopped"] is False and finished[-1]["steps"] == 5
    assert all(e["load_memory"].get("partitioned") is True for e in started)
    assert not any(e["memory_plan"]["host_parts"].get("offloaded weights", 0) for e in started)
    ref, got = step_losses(two_process_zero0), step_losses(run_dir)
    assert len(ref) == len(got) == 5  # step 1 before the stop, steps 2-5 after the resume
    assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-5, (ref, got)
    adapters_agree(two_process_zero0, run_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_over_loopback_match_one_machine(prepared, two_process_zero0):
    """Two launcher agents (torchrun, one per "machine") rendezvous over loopback, as a multi-node job does. Under
    ZeRO stage 1, so this one launch also proves stage 1 matches stage 0 (stages 2 and 3: test_zero_stages_...)."""
    spec = prepared(**COMMON, distributed__processes=1, distributed__zero_stage=1)
    port = _free_port()
    agents = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
               TRAINER, "--config", str(spec)]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       cwd=spec.parent, start_new_session=True))
    outputs = []
    for agent in agents:
        out, _ = agent.communicate(timeout=300)
        outputs.append(out)
        assert agent.returncode == 0, out[-4000:]
    ref, got = step_losses(two_process_zero0), step_losses(spec.parent)
    assert len(ref) == len(got) == 5
    assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-5, (ref, got)
    adapters_agree(two_process_zero0, spec.parent)


def _two_process_workflow(name: str, steps: int) -> dict:
    from conftest import load_workflow
    wf = {k: v for k, v in load_workflow().items() if k in {"1", "2", "3", "4", "5", "6", "7"}}
    wf["6"]["inputs"].update(steps=steps, output_name=name, precision="fp32", distributed=["30", 0])
    wf["30"] = {"class_type": "InGraphDeepSpeedSettings",
                "inputs": {"processes": 2, "zero_stage": "1", "offload_optimizer": False, "hostfile": ""}}
    evaluate_on_one_image(wf)  # evaluation (test_evaluation_is_identical_on_1_and_2_processes): not the point here
    return wf


def _wait_step(client, prompt_id):
    from conftest import wait_first_step
    return wait_first_step(client, prompt_id)


def _pids_of_group(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def test_two_process_run_from_comfyui_loads_in_lora_loader(comfy, client):
    outcome = client.run(_two_process_workflow("two_proc", 3), timeout=600)
    assert outcome.ok, outcome.error
    started = [m["data"]["event"] for m in outcome.messages if m.get("type") == "ingraph.event"
               and m["data"]["event"]["type"] == "started"][0]
    assert started["world_size"] == 2
    from conftest import load_workflow
    wf = load_workflow()
    loader = {k: wf[k] for k in ("1", "8", "9", "10", "11", "12")}
    loader["20"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1],
                                                           "lora_name": "two_proc.safetensors",
                                                           "strength_model": 1.0, "strength_clip": 0.0}}
    loader["11"]["inputs"]["model"] = ["20", 0]
    loader["21"] = {"class_type": "PreviewImage", "inputs": {"images": ["12", 0]}}
    assert client.run(loader, timeout=300).ok
    assert "lora key not loaded" not in comfy.log_text()


def test_cancelling_a_two_process_run_leaves_no_process(comfy, client):
    prompt_id = client.queue(_two_process_workflow("two_proc_cancel", 5000))
    run_id = _wait_step(client, prompt_id)["run_id"]
    pgid = int((comfy.base_dir / "output" / "ingraph" / "runs" / run_id / "trainer.pid").read_text())
    assert len(_pids_of_group(pgid)) >= 3  # launcher + 2 workers
    t0 = time.monotonic()
    client.interrupt()
    assert client.follow(prompt_id, timeout=60).status == "execution_interrupted"
    while _pids_of_group(pgid) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert _pids_of_group(pgid) == [], "a process of the run survived"
    print(f"\n2-process run: no process left {time.monotonic() - t0:.2f} s after POST /interrupt")


def test_killed_worker_fails_the_node_within_5s(comfy, client):
    prompt_id = client.queue(_two_process_workflow("two_proc_killed", 5000))
    run_id = _wait_step(client, prompt_id)["run_id"]
    run_dir = comfy.base_dir / "output" / "ingraph" / "runs" / run_id
    pgid = int((run_dir / "trainer.pid").read_text())
    workers = [p for p in _pids_of_group(pgid) if p != pgid and "--local_rank" in
               Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    assert len(workers) == 2
    t0 = time.monotonic()
    os.kill(max(workers), signal.SIGKILL)  # rank 1 (started second)
    outcome = client.follow(prompt_id, timeout=60)
    elapsed = time.monotonic() - t0
    assert outcome.status == "execution_error"
    assert elapsed < 5.0, f"{elapsed:.1f} s"
    message = outcome.error["exception_message"]
    assert "Training failed" in message and "trainer.log" in message
    assert wait_until(lambda: _pids_of_group(pgid) == [], 10, every=0.05), _pids_of_group(pgid)
    print(f"\nworker SIGKILL to node error: {elapsed:.2f} s")


def test_evaluation_is_identical_on_1_and_2_processes(one_process_runs):
    """The evaluate task of the same model and data: 1 process and 2 processes give the same numbers."""
    from ingraph_trainer.trainer.spec import dump_run_spec, load_run_spec
    one = one_process_runs("evaluate")
    spec = load_run_spec(one)
    two = one.parent.with_name(one.parent.name + "-2proc")
    two.mkdir()
    spec.run_dir = str(two)
    (two / "run.toml").write_text(dump_run_spec(spec))
    launch(two / "run.toml", 2)
    results = [next(e for e in read_events(d) if e["type"] == "finished")["evaluation"] for d in (one.parent, two)]
    assert results[0] == results[1]
    assert results[0]["items"] == 8 and len(results[0]["quantiles"]) == 5


@pytest.fixture(scope="module")
def wide_checkpoint(assets, tmp_path_factory):
    """The embedded default checkpoint with a wider, three-level SD1.5 UNet (323M parameters, 1.29 GB in fp32), so
    that a process's share of the weights stands out from what a run's start-up holds besides (~80 MB: the memory
    plan's pass, the adapter, the pages the kernel reads ahead in the file)."""
    from tools.embedded_default import TINY_UNET_CONFIG, _bootstrap, _init_weights, save_safetensors
    _bootstrap()
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    config = dict(TINY_UNET_CONFIG, channel_mult=[1, 2, 4], num_res_blocks=[1, 1, 1], transformer_depth=[1, 1, 1],
                  transformer_depth_output=[1] * 6)
    unet = UNetModel(**config, operations=comfy.ops.disable_weight_init)
    _init_weights(unet, torch.Generator().manual_seed(0))
    state = {k: v for k, v in load_file(assets["checkpoint"]).items() if not k.startswith("model.diffusion_model.")}
    state.update({f"model.diffusion_model.{k}": v.contiguous() for k, v in unet.state_dict().items()})
    del unet
    return save_safetensors(state, tmp_path_factory.mktemp("wide") / "wide_sd15.safetensors")


def test_zero3_loads_each_process_share_of_the_weights_not_the_whole_model(wide_checkpoint, assets, tools, tmp_path):
    """ZeRO-3 on 2 processes: ComfyUI builds the model unfilled, DeepSpeed partitions it, and each process copies its
    half of every weight from the file (trainer/parallel/partitioned_load.py). Each process's host memory rises by at most
    0.6x the model's weights during the load (it was over 1x: the whole model, built and filled, in each)."""
    args = ["--checkpoint", str(wide_checkpoint), "--images", str(assets["images"]), "--run-dir", str(tmp_path / "run")]
    for key, value in dict(train__steps=1, train__batch_size=1, train__precision="fp32", train__eval_items=0,
                           train__save_every=0, distributed__processes=2, distributed__zero_stage=3).items():
        args += ["--set", f"{key.replace('__', '.')}={json.dumps(value)}"]
    spec = Path(tools("prepare_run", args).strip().splitlines()[-1])
    run_trainer(spec, processes=2, kill_on="started")  # the load is over once the run starts (a step takes 20 s)
    started = read_events(spec.parent)[0]
    memory, whole = started["load_memory"], started["base_weight_bytes"]
    assert started["type"] == "started" and started["world_size"] == 2 and whole > 1.2e9
    print(f"\nZeRO-3 load, {whole / 1e6:.0f} MB of weights: each process's host memory rose "
          f"{[round(r / 1e6) for r in memory.get('rank_rises', [])]} MB")
    assert memory.get("partitioned") is True and len(memory["rank_rises"]) == 2, memory
    assert all(0 < rise <= 0.6 * whole for rise in memory["rank_rises"]), (memory, whole)


def test_zero3_full_fine_tune_on_2_processes_matches_1_process(prepared, one_process_runs):
    """Every weight sharded across 2 processes (ZeRO-3), gathered on rank 0 into one diffusion-model file."""
    one = one_process_runs("full")
    two = prepared(**FULL_FINE_TUNE, distributed__processes=2, distributed__zero_stage=3)
    launch(two, 2)
    ref, got = step_losses(one.parent), step_losses(two.parent)
    assert len(ref) == len(got) == 3
    assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-5, (ref, got)
    a, b = load_file(one.parent / "lora.safetensors"), load_file(two.parent / "lora.safetensors")
    assert set(a) == set(b) and all(a[k].shape == b[k].shape for k in a)  # whole tensors, not rank slices
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    ea, eb = (next(e for e in read_events(d) if e["type"] == "finished") for d in (one.parent, two.parent))
    assert eb["eval_after"] < eb["eval_before"] and abs(ea["eval_after"] - eb["eval_after"]) < 1e-5


def test_two_pipeline_stages_match_one_stage(prepared, reference):
    """The UNet split into 2 stages (skip connections crossing the cut) on 2 processes, micro-batch 2 with
    accumulation 2: the same losses and the same adapter as 1 process with the whole model."""
    spec = prepared(**COMMON, train__grad_accum=2, distributed__processes=2, distributed__pipeline_stages=2)
    launch(spec, 2)
    ref, got = step_losses(reference), step_losses(spec.parent)
    assert len(ref) == len(got) == 5 and max(abs(a - b) for a, b in zip(ref, got)) < 1e-5, (ref, got)
    adapters_agree(reference, spec.parent)
    started = read_events(spec.parent)[0]
    assert started["pipeline_stages"] == 2 and started["data_parallel"] == 1 and started["world_size"] == 2
    evals = [[e["loss"] for e in read_events(d) if e["type"] == "eval"] for d in (reference, spec.parent)]
    assert evals[0][0] == pytest.approx(evals[1][0], abs=1e-7)  # evaluation through the stages: same numbers
    checkpoints = [e for e in read_events(spec.parent) if e["type"] == "checkpoint"]
    assert [e["step"] for e in checkpoints] == [2, 4]
    # resume on the same layout from the step-4 checkpoint: the adapter of the uninterrupted run, bit for bit
    uninterrupted = load_file(spec.parent / "lora.safetensors")
    launch(spec, 2, "--resume", "step_000004")
    assert [e for e in read_events(spec.parent) if e["type"] == "started"][-1]["start_step"] == 4
    resumed = load_file(spec.parent / "lora.safetensors")
    assert uninterrupted.keys() == resumed.keys()
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def test_block_swap_and_gradient_checkpointing_match_plain_training(one_process_runs, reference):
    """Three blocks whose frozen weights live in CPU memory (recomputed in the backward pass), the other blocks
    gradient-checkpointed: the same losses as the plain run; under DeepSpeed's engine (ZeRO-1) to the layouts'
    parity bound (its fp32 path sums in another order)."""
    spec = one_process_runs("block_swap")
    ref, got = step_losses(reference), step_losses(spec.parent)
    assert len(ref) == len(got) == 5 and max(abs(a - b) for a, b in zip(ref, got)) < 1e-6, (ref, got)
    assert read_events(spec.parent)[0]["block_swap"] == 3
    zero1 = one_process_runs("block_swap_zero1")
    from ingraph_trainer.trainer.parallel.distributed import uses_deepspeed
    from ingraph_trainer.trainer.spec import load_run_spec
    assert uses_deepspeed(load_run_spec(zero1)) and read_events(zero1.parent)[0]["block_swap"] == 3
    got = step_losses(zero1.parent)
    assert len(got) == 5 and max(abs(a - b) for a, b in zip(ref, got)) < 1e-5, (ref, got)
