"""The GPU tier (`pytest -m gpu`): what only a real CUDA card shows. Skipped with one line where there is none.

Run on a lent GPU machine with scripts/gpu_smoke.sh's "tests:tests/trainer/test_gpu.py" stage
(docs/development.md); the CPU suite guards the same decisions with faked CUDA facts (tests/unit/test_unit.py).
Each test says which device its figures hold on."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import REPO, load_workflow, read_events, run_trainer, run_trainers_forked

# asked through NVML (conftest sets PYTORCH_NVML_BASED_CUDA_CHECK): this process starts no CUDA context, so the
# children the suite's workers fork can still use the GPU
HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.comfyui,
              pytest.mark.skipif(not HAS_CUDA, reason="skipped: no CUDA device (the GPU tier, pytest -m gpu)")]


def trained(spec, *extra, **kwargs):
    proc = run_trainer(spec, *extra, **kwargs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = read_events(spec.parent)
    assert events[-1]["type"] == "finished", events[-3:]
    return events


def test_a_run_trains_on_the_gpu_in_its_precision_and_reports_device_memory(prepared):
    spec = prepared(train__steps=4, train__batch_size=2, train__precision="auto", train__eval_quantiles=[0.5])
    events = trained(spec)
    started, finished = events[0], events[-1]
    assert started["device"] == "cuda:0"
    # "auto": bf16 where the card computes in it (Ampere and newer), fp16 with loss scaling before
    expected = "bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp16"
    assert started["precision"] == expected
    memory = finished["device_memory"]
    assert 0 < memory["peak_allocated"] <= memory["peak_reserved"] <= memory["total"]
    losses = [e["loss"] for e in events if e["type"] == "step"]
    assert len(losses) == 4 and all(l == l for l in losses)
    assert (spec.parent / "lora.safetensors").is_file()


def test_stop_then_resume_on_the_gpu_follows_the_uninterrupted_run(prepared):
    """Adapter dropout draws from the CUDA generator, so a resume that did not restore it differs at once (by ~1e-2).
    Two uninterrupted runs bound what the card's own kernels vary (attention's backward may add in any order); the
    resumed run must stay within that bound of the uninterrupted one (on an H100/H200: bit for bit, or the bound)."""
    settings = dict(train__steps=5, train__batch_size=2, train__precision="bf16", train__seed=3, train__save_every=2,
                    train__eval_quantiles=[0.5], adapter__dropout=0.1, train__learning_rate=1e-3)
    first, second = (prepared(**settings) for _ in range(2))
    proc = run_trainers_forked(first, second)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [{e["step"]: e["loss"] for e in read_events(s.parent) if e["type"] == "step"} for s in (first, second)]
    assert len(runs[0]) == len(runs[1]) == 5
    kernel_noise = max(abs(runs[0][k] - runs[1][k]) for k in runs[0])

    stopped = prepared(**settings)
    assert run_trainer(stopped, kill_on="checkpoint").returncode != 0
    assert [p.name for p in sorted((stopped.parent / "checkpoints").glob("step_*"))] == ["step_000002"]
    events = trained(stopped, "--resume", "latest")
    assert [e["start_step"] for e in events if e["type"] == "started"][-1] == 2
    resumed = {e["step"]: e["loss"] for e in events if e["type"] == "step"}
    assert resumed.keys() == runs[0].keys()
    drift = max(abs(resumed[k] - runs[0][k]) for k in (3, 4, 5))
    print(f"GPU resume on {torch.cuda.get_device_name(0)}: two uninterrupted runs differ by {kernel_noise:.3g}, "
          f"the resumed one by {drift:.3g}")
    assert drift <= max(2 * kernel_noise, 1e-6), (resumed, runs[0], kernel_noise)


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"])
def test_an_fp8_base_trains_and_evaluates_with_its_lora_on_the_card(prepared, assets, tmp_path_factory, weight_dtype):
    """UNETLoader's fp8 weight dtypes on a card that computes in fp8 (ComfyUI's fp8 matmul path, which has no
    backward, is asked for by the _fast variant): the LoRA trains, then the evaluate task runs the base with it."""
    from safetensors.torch import load_file, save_file
    prefix = "model.diffusion_model."
    unet = tmp_path_factory.mktemp("gpu_fp8") / "unet.safetensors"
    save_file({k[len(prefix):]: v.to(torch.bfloat16) if v.is_floating_point() else v
               for k, v in load_file(assets["checkpoint"]).items() if k.startswith(prefix)}, unet)
    model = dict(model__path=str(unet), model__format="diffusion_model", model__weight_dtype=weight_dtype,
                 model__lora_paths=[], model__lora_strengths=[], model__stamps=[])
    spec = prepared(train__steps=3, train__batch_size=2, train__precision="bf16", adapter__rank=4,
                    adapter__alpha=4.0, train__eval_quantiles=[0.5], **model)
    events = trained(spec)
    losses = [e["loss"] for e in events if e["type"] == "step"]
    assert len(losses) == 3 and all(isinstance(l, float) and l == l for l in losses)
    lora = events[-1]["adapter"]
    assert lora and os.path.isfile(lora)
    evaluate = prepared(task="evaluate", output__lora_path="", train__batch_size=2, train__precision="bf16",
                        train__eval_quantiles=[0.5], **dict(model, model__lora_paths=[lora],
                                                             model__lora_strengths=[1.0]))
    result = trained(evaluate)[-1]["evaluation"]
    assert result["loss"] == result["loss"] and result["loss"] > 0
    fp8_compute = torch.cuda.get_device_capability(0) >= (8, 9)  # ComfyUI's supports_fp8_compute, read here
    print(f"{weight_dtype} on {torch.cuda.get_device_name(0)} (computes in fp8: {fp8_compute}): "
          f"trained loss {[e['loss'] for e in events if e['type'] == 'step']}, evaluated with the LoRA "
          f"{result['loss']:.5f}")


def _gpu_used_mib() -> tuple[int, dict]:
    """The card's memory in use (nvidia-smi, MiB) and, where the driver lists them, each process's."""
    import subprocess
    total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=30).stdout.split()
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=30).stdout
    per_process = {}
    for line in apps.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit() and used.strip().isdigit():
            per_process[int(pid)] = int(used)
    return int(total[0]), per_process


def test_a_comfyui_server_on_the_card_leaves_it_to_the_trainer(assets, tmp_path):
    """Issue 27 on a card, on either ComfyUI (0.33 keeps the models a workflow uses loaded, with dynamic VRAM): a
    graph whose MODEL is a full-size SD1.5 (random weights: 1.6 GB of UNet in fp16, which ComfyUI would hold on
    the card) trains while ComfyUI holds no loaded model and none of the model's bytes on the card. The ComfyUI
    process's memory is read per process where the driver lists processes, else as the card's use above its idle
    level less the trainer's own (its reserved peak and a CUDA context)."""
    import json
    import subprocess
    import sys
    import time
    from client.api import ComfyClient
    from tools.comfy_server import ComfyServer
    checkpoint = tmp_path / "sd15.safetensors"
    built = subprocess.run([sys.executable, str(REPO / "tools" / "realsize_models.py"), "--sd15", str(checkpoint)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    server = ComfyServer(tmp_path / "comfy", cpu=False, extra_env={"INGRAPH_STANDBY": "0"})
    (server.dir("models", "checkpoints") / "sd15.safetensors").symlink_to(checkpoint)
    images = server.dir("input", "gpu_images")
    for f in assets["images"].iterdir():
        (images / f.name).write_bytes(f.read_bytes())
    wf = {k: v for k, v in load_workflow().items() if k in {"1", "2", "3", "4", "5", "6", "7"}}  # no sampler after
    wf["1"]["inputs"]["ckpt_name"] = "sd15.safetensors"
    wf["2"]["inputs"]["folder"] = "gpu_images"
    wf["6"]["inputs"].update(steps=100000, output_name="gpu_handoff", precision="bf16")
    server.start()
    try:
        server.wait_ready(300)
        client = ComfyClient(server.address)
        idle, _ = _gpu_used_mib()
        prompt_id = client.queue(wf)
        data, first = client.wait_for_step(prompt_id, 5, 600)
        time.sleep(2)  # a few steps more: the trainer's memory at its working level
        training, per_process = _gpu_used_mib()
        stats = client.get("/system_stats")
        assert client.post(f"/ingraph/runs/{data['run_id']}/stop")["stop_requested"] is True
        outcome = client.follow(prompt_id, timeout=300)
        client.close()
    finally:
        server.stop()
    log = server.log_text()
    assert outcome.ok, json.dumps(outcome.error)[:3000]
    assert "ComfyUI holds 0 loaded model(s) as the trainer starts (the trained model: not loaded)" in log, log[-3000:]
    finished = [m["data"]["event"] for m in outcome.messages if m.get("type") == "ingraph.event"
                and m["data"]["event"]["type"] == "finished"][-1]
    assert finished["steps"] >= 5 and finished["device_memory"]["peak_reserved"] > 0
    trainer_mib = finished["device_memory"]["peak_reserved"] / 2**20
    comfy_torch_mib = stats["devices"][0]["torch_vram_total"] / 2**20  # ComfyUI's own allocator, reserved
    if server.proc.pid in per_process:
        comfy_mib, how = per_process[server.proc.pid], "the driver's figure for its process"
    else:
        comfy_mib, how = training - idle - trainer_mib - 600, "the card's use less the trainer's and a context"
    dynamic = "aimdo" in log.lower() or "dynamicvram" in log.lower().replace(" ", "")
    print(f"on {torch.cuda.get_device_name(0)} (ComfyUI's log names dynamic VRAM: {dynamic}): while training, "
          f"ComfyUI held {comfy_mib:.0f} MiB ({how}; its torch "
          f"allocator {comfy_torch_mib:.0f} MiB reserved), the trainer reserved {trainer_mib:.0f} MiB at its peak")
    assert comfy_torch_mib < 256, stats
    assert comfy_mib < 1024, (comfy_mib, how, idle, training, per_process)  # a context; the UNet alone is 1.6 GB
