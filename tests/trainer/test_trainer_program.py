"""Trainer tier: the trainer launched for real as a program on the tiny model."""
from __future__ import annotations

import json
import math
import re
import signal
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import REPO, read_events, requires_deepspeed, run_trainer, run_trainer_program

pytestmark = pytest.mark.comfyui

# the fixed-noise evaluation (before the first step, after the last) at one timestep quantile, not five: where the
# evaluation's numbers are not the point, it costs 8 forward passes instead of 40
ONE_QUANTILE = dict(train__eval_quantiles=[0.5])


@pytest.fixture(scope="module")
def two_step_run(prepared):
    """One 2-step run that several tests read (each trainer launch costs ~12 s of imports): events and adapter,
    stdout noise, an incomplete checkpoint that `--resume latest` must ignore, TensorBoard metrics. It uses the
    non-default objective (Huber, min-SNR), so that path runs too (its formulas: tests/unit/test_unit.py). The program
    started as `python trainer` (the other runs here: conftest's forked trainer worker)."""
    spec = prepared(train__steps=2, train__batch_size=2, train__precision="fp32", adapter__alpha=4.0,
                    adapter__rank=4, train__loss="huber", train__min_snr_gamma=5.0, **ONE_QUANTILE)
    half = spec.parent / "checkpoints" / "step_000001"
    half.mkdir(parents=True)
    (half / "trainer_state.json").write_text('{"step": 1}')  # no COMPLETE mark
    return spec, run_trainer_program(spec, "--resume", "latest")


def test_two_steps_write_events_and_a_comfy_format_adapter(two_step_run):
    spec, proc = two_step_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = spec.parent
    events = read_events(run_dir)
    kinds = [e["type"] for e in events]
    assert kinds == ["started", "step", "step", "eval", "finished"]  # no evaluation before step 1 (eval_before)
    steps = [e for e in events if e["type"] == "step"]
    for e in steps:
        assert {"step", "total", "loss", "lr", "grad_norm", "samples_per_s", "eta_s"} <= set(e)
        assert e["total"] == 2 and e["grad_norm"] > 0
    finished = events[-1]
    adapter = Path(finished["adapter"])
    assert adapter == run_dir / "lora.safetensors" and oct(adapter.stat().st_mode & 0o777) == "0o644"
    tensors = load_file(adapter)
    downs = [k for k in tensors if k.endswith(".lora_down.weight")]
    assert len(downs) == events[0]["adapted_modules"] > 0
    for key in downs:
        module = key[: -len(".lora_down.weight")]
        assert key.startswith("diffusion_model.")
        assert tensors[f"{module}.lora_up.weight"].shape[1] == tensors[key].shape[0] == 4
        alpha = tensors[f"{module}.alpha"]
        assert alpha.dtype == __import__("torch").float32 and alpha.item() == 4.0
    assert not any("lora_A" in k or "lora_B" in k or ".default" in k for k in tensors)
    with safe_open(str(adapter), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "4.0"
    assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_steps"] == "2"
    assert not list(run_dir.glob(".lora-*.partial"))


def test_bad_spec_exits_2_naming_the_field(two_step_run, tmp_path):
    spec, _ = two_step_run
    bad = tmp_path / "bad.toml"
    bad.write_text(re.sub(r"(?m)^steps = 2$", "steps = 0", spec.read_text()))  # [train] steps only
    proc = run_trainer_program(bad)
    assert proc.returncode == 2
    assert "bad.toml" in proc.stderr and "train.steps: must be at least 1" in proc.stderr
    errors = [e for e in read_events(tmp_path) if e["type"] == "error"]  # what the node relays
    assert len(errors) == 1 and "train.steps: must be at least 1" in errors[0]["message"]


@pytest.mark.parametrize("wrong", ["latents", "captions"])
def test_a_dataset_cached_for_another_model_is_refused_at_start_naming_the_setting(two_step_run, tmp_path, wrong):
    """A dataset whose latents were cached with another model's VAE (16 channels, as a Flux or SD3 VAE gives), or
    whose captions were encoded with another model's text encoder (2048 wide, as SDXL's gives), for the tiny SD1.5
    model (4 channels, 768 wide): the run ends at start-up, before any step, with one error event naming
    data.manifest, both figures and the fix. It failed with the UNet's first convolution's, or its first
    cross-attention's, shape error."""
    import torch
    from clip_caching import SyntheticClip
    from media_files import cached_captions
    from ingraph_trainer.trainer.data.loading import load_cached_dataset
    channels, width = (16, 768) if wrong == "latents" else (4, 2048)

    class TextEncoder(SyntheticClip):
        def encode_from_tokens(self, text, return_pooled=True, return_dict=True):
            return {"cond": torch.full((1, 77, width), float(len(text))), "pooled_output": None}
    spec, _ = two_step_run
    manifest = re.search(r'(?m)^manifest = "(.*)"$', spec.read_text()).group(1)
    ours = load_cached_dataset(manifest)
    assert ours.latent(0).shape[0] == 4 and ours.text(0)["cond"].shape[-1] == 768  # precondition: the model's
    (tmp_path / "data").mkdir()
    _, cached, _ = cached_captions(tmp_path / "data", TextEncoder(), {"cat": "a cat"}, latent_channels=channels)
    assert (cached.latent(0).shape[0], cached.text(0)["cond"].shape[-1]) == (channels, width)
    other = tmp_path / "run" / "run.toml"
    other.parent.mkdir()
    other.write_text(spec.read_text().replace(f'"{manifest}"', f'"{tmp_path / "data" / "m.json"}"')
                     .replace(f'"{spec.parent}', f'"{other.parent}'))
    proc = run_trainer(other)
    events = read_events(other.parent)
    assert proc.returncode != 0 and events, proc.stderr[-3000:]
    assert not [e for e in events if e["type"] == "step"]
    (error,) = [e for e in events if e["type"] == "error"]
    expected = {"latents": "data.manifest: its latents have 16 channels, and this SD1.x/SD2.x UNet model takes 4: "
                           "they were cached with another model's VAE; connect this model's own VAE to Cache "
                           "Latents' vae",
                "captions": "data.manifest: its captions' embeddings are 2048 wide, and this SD1.x/SD2.x UNet model "
                            "takes 768: they were encoded with another model's text encoder; connect this model's "
                            "own CLIP to Cache Text Embeddings' clip"}[wrong]
    assert expected in error["message"], error


def test_stdout_noise_never_becomes_an_event(two_step_run):
    spec, proc = two_step_run
    assert proc.returncode == 0
    # DeepSpeed and ComfyUI print plenty to the log (ComfyUI its memory on every device, DeepSpeed its accelerator
    # on a CPU); the event file has only well-formed events
    assert "total vram" in (proc.stdout + proc.stderr).lower()
    for line in (spec.parent / "events.jsonl").read_text().splitlines():
        assert json.loads(line)["v"] == 1


def test_resume_after_kill_matches_uninterrupted_run_bit_for_bit(prepared):
    """fp32 on CPU: killed after the step-3 checkpoint and resumed == never interrupted."""
    common = dict(train__steps=6, train__batch_size=2, train__precision="fp32", train__save_every=3,
                  adapter__dropout=0.1, train__lr_schedule="cosine", train__warmup_steps=2, **ONE_QUANTILE)
    straight = prepared(**common)
    assert run_trainer(straight).returncode == 0

    interrupted = prepared(**common)
    run_dir = interrupted.parent
    killed = run_trainer(interrupted, kill_on="checkpoint")  # SIGKILLed once its step-3 checkpoint event is written
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert any(e["type"] == "checkpoint" for e in read_events(run_dir))
    assert not (run_dir / "lora.safetensors").exists()
    spec_before = interrupted.read_text()
    resumed = run_trainer(interrupted, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert interrupted.read_text() == spec_before  # the saved spec is never rewritten
    started = [e for e in read_events(run_dir) if e["type"] == "started"]
    assert started[-1]["start_step"] == 3 and started[-1]["resumed_from"].endswith("step_000003")

    a = load_file(straight.parent / "lora.safetensors")
    b = load_file(run_dir / "lora.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] == b[key]).all(), key
    losses = lambda d: [e["loss"] for e in read_events(d) if e["type"] == "step"]  # noqa: E731
    assert losses(straight.parent)[3:] == losses(run_dir)[-3:]


def test_incomplete_checkpoint_is_never_resumed(two_step_run):
    spec, proc = two_step_run  # launched with --resume latest beside a checkpoint that has no COMPLETE mark
    assert (spec.parent / "checkpoints" / "step_000001" / "trainer_state.json").is_file()
    assert proc.returncode == 0
    assert read_events(spec.parent)[0]["start_step"] == 0


def test_tensorboard_has_the_health_metrics(two_step_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    spec, proc = two_step_run
    assert proc.returncode == 0
    started = read_events(spec.parent)[0]
    assert started["objective"] == {"loss": "huber", "min_snr_gamma": 5.0}
    acc = EventAccumulator(str(spec.parent / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/param_norm", "perf/step_time_s",
                "perf/samples_per_s", "data/timestep_mean", "data/timestep_std", "data/latent_std", "eval/loss"):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]


@requires_deepspeed
def test_8bit_adamw_with_optimizer_offload_under_zero1(prepared):
    spec = prepared(train__steps=4, train__precision="fp32", train__optimizer="adamw8bit",
                    distributed__zero_stage=1, distributed__offload_optimizer=True, train__learning_rate=1e-3,
                    train__eval_before=True, **ONE_QUANTILE)
    proc = run_trainer(spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_events(spec.parent)
    finished = events[-1]
    assert finished["type"] == "finished" and finished["eval_after"] < finished["eval_before"]
    assert load_file(spec.parent / "lora.safetensors")


def test_continue_from_an_adapter_file_starts_where_it_ended(prepared, trained_in_format):
    """A run started from another run's kohya-format file evaluates, before its first step, exactly
    as that run did after its last (another alpha, so the scale is carried over)."""
    from conftest import FORMAT_RUN
    first = trained_in_format("kohya")  # alpha 8, rank 4, attention and feed-forward layers
    ended = next(e for e in read_events(first.parent) if e["type"] == "finished")
    second = prepared(train__steps=1, train__precision="fp32", adapter__rank=4, adapter__alpha=4.0,
                      adapter__targets=FORMAT_RUN["adapter__targets"], adapter__init_from=ended["adapter"],
                      train__eval_quantiles=FORMAT_RUN["train__eval_quantiles"], train__eval_before=True)
    proc = run_trainer(second)
    assert proc.returncode == 0, proc.stderr[-3000:]
    began = next(e for e in read_events(second.parent) if e["type"] == "eval")
    assert began["step"] == 0 and began["loss"] == pytest.approx(ended["eval_after"], rel=1e-6)
    assert began["loss"] != pytest.approx(ended["eval_before"], rel=1e-4)  # not a fresh (zero) adapter


def test_out_of_memory_at_step_3_names_the_step_and_what_would_fit_and_step_2_resumes(prepared):
    """Issue 30: a device out of memory mid-run (raised on purpose here, as a full card raises it) ends the run with
    an error that names the step and the settings that would lower the memory, cheapest first; the step-2
    checkpoint stays intact and resumes."""
    spec = prepared(train__steps=4, train__save_every=1, train__precision="fp32", adapter__rank=4,
                    train__batch_size=2, **ONE_QUANTILE)
    run_dir = spec.parent
    proc = run_trainer(spec, env={"INGRAPH_OOM_AT_STEP": "3"}, patch="inject_oom")
    events = read_events(run_dir)
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 2], proc.stderr[-3000:]
    assert proc.returncode != 0
    (error,) = [e for e in events if e["type"] == "error"]
    assert error["message"] == (
        "OutOfDeviceMemory: out of GPU memory at step 3: turn on gradient_checkpointing; or set base_precision to "
        "fp8; or set block_swap (DeepSpeed Settings) to some of the model's blocks; or lower batch_size to 1 and "
        "raise gradient_accumulation to 2 (the same batch); or train at a lower resolution. The last complete "
        "checkpoint is intact."), error["message"]
    assert (run_dir / "checkpoints" / "step_000002" / "COMPLETE").is_file()
    resumed = run_trainer(spec, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [e["step"] for e in read_events(run_dir)[len(events):] if e["type"] == "step"] == [3, 4]


def test_nan_at_step_3_ends_the_run_and_step_2_resumes(prepared):
    spec = prepared(train__steps=4, train__save_every=1, train__precision="fp32", adapter__rank=4, **ONE_QUANTILE)
    run_dir = spec.parent
    proc = run_trainer(spec, env={"INGRAPH_NAN_AT_STEP": "3"}, patch="inject_nan")  # forked, its loss patched
    events = read_events(run_dir)
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 2], proc.stderr[-3000:]  # it really trained
    assert proc.returncode != 0
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and "loss became NaN at step 3" in errors[0]["message"]
    assert not any(e["type"] == "finished" for e in events)
    tags = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert tags[-1] == "step_000002" and (run_dir / "checkpoints" / "step_000002" / "COMPLETE").is_file()
    assert not (run_dir / "lora.safetensors").exists()

    resumed = run_trainer(spec, "--resume", "latest")  # the plain trainer: nothing injected
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = read_events(run_dir)[len(events):]
    assert [e for e in after if e["type"] == "started"][0]["start_step"] == 2
    assert [e["step"] for e in after if e["type"] == "step"] == [3, 4]
    assert all(math.isfinite(e["loss"]) for e in after if e["type"] == "step")
    assert (run_dir / "lora.safetensors").is_file()


def test_by_hand_a_finished_run_is_not_trained_again_unasked_and_progress_is_printed(prepared):
    """The standalone trainer (as a user types it): a finished run's spec is refused naming what to do; --again
    trains it once more, printing its progress and where the result went, the earlier LoRA kept as .previous."""
    spec = prepared(train__steps=2, train__precision="fp32", **ONE_QUANTILE)
    assert run_trainer(spec).returncode == 0
    first = (spec.parent / "lora.safetensors").read_bytes()
    events_before = read_events(spec.parent)
    refused = run_trainer_program(spec)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"error: {spec.parent} already finished (its result: {spec.parent / 'lora.safetensors'}); --resume " \
           "latest continues it from its last checkpoint, --again trains it once more from the start" in refused.stderr
    assert read_events(spec.parent) == events_before and (spec.parent / "lora.safetensors").read_bytes() == first
    again = run_trainer_program(spec, "--again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step 1/2: loss " in again.stderr and "step 2/2: loss " in again.stderr
    kept = spec.parent / "lora.previous.safetensors"
    assert f"finished after 2 steps: {spec.parent / 'lora.safetensors'} (the file it replaced is kept as {kept})" \
        in again.stderr
    assert kept.read_bytes() == first


def test_the_coverage_run_trains_a_class_by_the_trainer_program_and_its_lora_loads_in_comfyui(tools, tmp_path):
    """Issue 34: tools/family_coverage.py --train trains a class of ComfyUI's list by the trainer program, handed the
    model as a file and a cache of random latents and text (tools/coverage_runs.py). HunyuanDiT: its text entries
    carry the attention mask and the encoder's extra outputs (its mT5 embedding and mask), which the generic family
    hands to ComfyUI's extra_conds; the adapter file the trainer wrote loads in ComfyUI and changes the output."""
    out = tmp_path / "coverage.json"
    printed = tools("family_coverage", ["--train", "--only", "tiny HunyuanDiT", "--json", out], timeout=240)
    assert "trainer program: yes" in printed, printed[-2000:]
    rows = {r["class"]: r for r in json.loads(out.read_text())["rows"]}
    row = rows["HunyuanDiT"]
    assert row["builders"] == ["tiny HunyuanDiT"] and row["family"] == ["generic"]
    assert row["trained"] == ["yes"] and row["loads"] == ["yes"] and row["changes"][0].startswith("yes"), row
    assert len(row["step_s"]) == 1 and row["step_s"][0] > 0
    assert not any(r["builders"] for name, r in rows.items() if name != "HunyuanDiT")  # --only: this one alone


def test_the_trainer_and_the_client_started_by_another_python_say_which_one_to_use(tmp_path):
    import shutil
    other = next((p for p in ("/usr/bin/python3", shutil.which("python3")) if p and subprocess.run(
        [p, "-c", "import torch"], capture_output=True).returncode != 0), None)
    if other is None:
        pytest.skip("skipped: every python3 here has torch")
    for program, needle in (("trainer", "has no torch. Run the trainer with ComfyUI's Python"),
                            ("client", "lacks websocket-client. Run the client with ComfyUI's Python")):
        proc = subprocess.run([other, str(REPO / program), "--help"], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
