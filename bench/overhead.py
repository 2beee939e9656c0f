"""The trainer's overhead: its seconds per step against a bare PyTorch loop on this machine, and their ratio on the
last line (the target is at most 1.05).

Both train the same ComfyUI model (the tiny SD1.5 of bench/step_losses.py, or any prepared run spec) with the same
adapter, on the same cached batches (the trainer's own StepSampler order, noise and timesteps), with the same
optimizer and gradient clipping. The bare loop is what a hand-written script would do: forward, backward, clip,
step, no DeepSpeed, no events, no health metrics, no prefetch thread. The trainer is the real program, and its
seconds per step are the gaps between its step events (so events, health metrics and checkpoint checks count).
Medians of the steady steps; the runs alternate `--repeats` times and the best median of each side is kept
(other work on the machine only ever slows a run down).

    python bench/overhead.py [--steps 40 --warmup 5 --repeats 2 --spec RUN.toml]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def bench_spec(work: Path, steps: int, base: Path | None) -> Path:
    """A copy of the run spec with `steps` steps, no evaluation in between and no checkpoints."""
    from bench.step_losses import fresh_run, prepared_spec
    _register_package()
    from ingraph_trainer.trainer.config import dump_run_spec, load_run_spec
    spec_path = fresh_run(base or prepared_spec(work), work / "overhead")
    spec = load_run_spec(spec_path)
    spec.train.steps, spec.train.save_every, spec.train.eval_every = steps, 0, 0
    spec.train.eval_quantiles = [0.5]
    spec_path.write_text(dump_run_spec(spec))
    return spec_path


def _register_package():
    import types
    if "ingraph_trainer" not in sys.modules:
        package = types.ModuleType("ingraph_trainer")
        package.__path__ = [str(REPO)]
        sys.modules["ingraph_trainer"] = package


def trainer_step_times(spec_path: Path) -> list[float]:
    events = spec_path.parent / "events.jsonl"
    events.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, str(REPO / "trainer"), "--config", str(spec_path)], capture_output=True,
                          text=True, cwd=spec_path.parent)
    if proc.returncode:
        sys.exit(f"trainer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    times = [json.loads(line)["time"] for line in events.read_text().splitlines()
             if json.loads(line)["type"] == "step"]
    return [b - a for a, b in zip(times, times[1:])]


def bare_step_times(spec_path: Path) -> list[float]:
    """The same steps in a plain loop, in a fresh process (as the trainer gets one)."""
    out = subprocess.run([sys.executable, __file__, "--bare", str(spec_path)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"bare loop failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bare_loop(spec_path: Path) -> list[float]:
    _register_package()
    import torch
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.comfy_env import import_comfy
    from ingraph_trainer.trainer.config import load_run_spec
    from ingraph_trainer.trainer.batch_mix import StepBatches, build_training_data
    from ingraph_trainer.trainer.models import Batch, load_family
    from ingraph_trainer.trainer.optim import build_optimizer, build_scheduler
    spec = load_run_spec(spec_path)
    t, a = spec.train, spec.adapter
    import_comfy()
    family = load_family(spec.model, precision=t.precision)
    family.set_objective(t.loss, t.huber_delta, t.min_snr_gamma, t.flow_shift, t.guidance)
    torch.manual_seed(t.seed)
    params = inject_adapter(family.diffusion_model, family.adapter_targets(a.targets), a.kind, a.rank, a.alpha,
                            a.dropout)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    family.diffusion_model.to(device=device, dtype=dtype)
    optimizer = build_optimizer(spec, params)
    scheduler = build_scheduler(spec, optimizer)
    load = StepBatches(*build_training_data(spec.data, t.batch_size * t.grad_accum, t.seed), t, spec.data, 1, 0)
    steps = [load(s).micro_batches for s in range(t.steps)]  # every batch ready: the loop alone is timed
    times = []
    for micro_batches in steps:
        t0 = time.perf_counter()
        for latents, cond, noise, timesteps, pooled, *_ in micro_batches:  # a plain run: no masks, no prior set
            batch = Batch(latents.to(device, dtype), cond.to(device, dtype),
                          pooled.to(device, dtype) if pooled is not None else None, noise.to(device, dtype),
                          timesteps.to(device))
            loss = family.loss(batch) / t.grad_accum
            loss.backward()
        if t.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # what any loop reads back once a step (a log line, a NaN check)
        times.append(time.perf_counter() - t0)
    return times


def steady(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] or times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median (first-step costs)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--spec", type=Path, default=None, help="a prepared run spec (default: the tiny SD1.5)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ingraph-step-losses"))
    parser.add_argument("--bare", type=Path, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.bare:
        print(json.dumps(bare_loop(opts.bare)))
        return
    spec = bench_spec(opts.work, opts.steps, opts.spec)
    ours, bare = [], []
    for _ in range(opts.repeats):
        ours.append(steady(trainer_step_times(spec), opts.warmup))
        bare.append(steady(bare_step_times(spec), opts.warmup))
        print(f"trainer {ours[-1]:.4f} s/step, bare loop {bare[-1]:.4f} s/step", flush=True)
    print(f"trainer s/step {min(ours):.4f}")
    print(f"bare PyTorch s/step {min(bare):.4f}")
    print(f"ratio {min(ours) / min(bare):.3f}")


if __name__ == "__main__":
    main()
