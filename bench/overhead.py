"""The trainer's overhead: its seconds per step against a bare PyTorch loop on this machine, and their ratio on the
last line (issue 31 asks at most 1.02).

Both train the same ComfyUI model (the tiny SD1.5 of bench/step_losses.py, or any prepared run spec) with the same
adapter, on the same cached batches (the trainer's own StepSampler order, noise and timesteps), with the same
optimizer and gradient clipping. The bare loop is what a hand-written script would do: forward, backward, clip,
step, no DeepSpeed, no events, no health metrics, no prefetch thread. The trainer is the real program
(trainer/main.py, its loop, events, health metrics and checkpoint checks all count).

This machine's speed drifts by tens of percent within seconds (the same bare loop: 0.21 to 0.41 s a step in one
run), so runs taken one after the other compare moments, not code. By default the two take their steps in turns
in one process: each time the trainer's loop asks for a step's batches, the bare loop first takes one of its own;
each trainer step is set against the bare step beside it, and the last line is the median of those ratios over
the steady steps of `--repeats` runs. `--separate` runs each side in a process of its own, one after the other
(the trainer as the node launches it), and keeps the best median of each side.

    python bench/overhead.py [--steps 40 --warmup 5 --repeats 2 --spec RUN.toml] [--separate]
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
    from ingraph_trainer.trainer.spec import dump_run_spec, load_run_spec
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


class BareLoop:
    """What a hand-written script does: forward, backward, clip, step; every step's batches made beforehand."""

    def __init__(self, spec_path: Path):
        _register_package()
        import torch
        from ingraph_trainer.trainer.adapters import inject_adapter
        from ingraph_trainer.trainer.comfy_env import import_comfy
        from ingraph_trainer.trainer.spec import load_run_spec
        from ingraph_trainer.trainer.data.batch_mix import StepBatches, build_training_data
        from ingraph_trainer.trainer.models import load_family
        from ingraph_trainer.trainer.optim import build_optimizer, build_scheduler
        spec = load_run_spec(spec_path)
        self.t, a = t, a = spec.train, spec.adapter
        import_comfy()
        self.family = family = load_family(spec.model, precision=t.precision)
        family.set_objective(t.loss, t.huber_delta, t.min_snr_gamma, t.flow_shift, t.guidance)
        torch.manual_seed(t.seed)
        self.params = inject_adapter(family.diffusion_model, family.adapter_targets(a.targets, a.kind), a.kind, a.rank,
                                     a.alpha, a.dropout)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
        family.diffusion_model.to(device=self.device, dtype=self.dtype)
        self.optimizer = build_optimizer(spec, self.params)
        self.scheduler = build_scheduler(spec, self.optimizer)
        load = StepBatches(*build_training_data(spec.data, t.batch_size * t.grad_accum, t.seed), t, spec.data, 1, 0)
        self.steps = [load(s).micro_batches for s in range(t.steps)]  # every batch ready: the loop alone is timed

    def step(self, index: int) -> float:
        """One optimizer step; its seconds."""
        import torch
        from ingraph_trainer.trainer.models import Batch
        t, device, dtype = self.t, self.device, self.dtype
        t0 = time.perf_counter()
        for latents, cond, noise, timesteps, pooled, *_ in self.steps[index]:  # a plain run: no masks, no priors
            batch = Batch(latents.to(device, dtype), cond.to(device, dtype),
                          pooled.to(device, dtype) if pooled is not None else None, noise.to(device, dtype),
                          timesteps.to(device))
            loss = self.family.loss(batch) / t.grad_accum
            loss.backward()
        if t.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # what any loop reads back once a step (a log line, a NaN check)
        return time.perf_counter() - t0


def bare_loop(spec_path: Path) -> list[float]:
    bare = BareLoop(spec_path)
    return [bare.step(s) for s in range(len(bare.steps))]


def interleaved_step_times(spec_path: Path) -> tuple[list[float], list[float]]:
    """(the trainer's, the bare loop's) seconds per step, taken in turns in one fresh process: each time the
    trainer's loop asks for a step's batches, the bare loop first takes a step of its own. Both see the same
    moment of the machine, whose speed drifts by tens of percent within seconds here. The trainer is the real
    program (trainer/main.py, its loop, events, health metrics); its step is all it does from one request for
    batches to the next, the bare step left out."""
    out = subprocess.run([sys.executable, __file__, "--interleaved", str(spec_path)], capture_output=True, text=True,
                         cwd=spec_path.parent)
    if out.returncode:
        sys.exit(f"interleaved run failed:\n{out.stderr[-3000:]}")
    ours, bare = json.loads(out.stdout.strip().splitlines()[-1])
    return ours, bare


def interleaved_run(spec_path: Path) -> tuple[list[float], list[float]]:
    import torch
    bare = BareLoop(spec_path)
    from ingraph_trainer.trainer.tasks import base as loop  # the task base: where the loop asks for batches
    from ingraph_trainer.trainer.main import main as trainer_main
    own_loader, bare_times, asked = loop.step_loader, [], []

    class Interleaved:
        def __init__(self, load, device):
            self.inner = own_loader(load, device)

        def get(self, step: int, next_step):
            if torch.cuda.is_available():  # the trainer's queued kernels count to it, not to the bare step
                torch.cuda.synchronize()
            bare_times.append(bare.step(step))
            asked.append(time.perf_counter())
            return self.inner.get(step, next_step)

        def close(self):
            self.inner.close()

    loop.step_loader = Interleaved
    if trainer_main(["--config", str(spec_path), "--again"]):  # each repeat trains the same spec once more
        sys.exit("trainer failed")
    ours = [b - a - bare_step for a, b, bare_step in zip(asked, asked[1:], bare_times[1:])]
    return ours, bare_times[1:]


def steady(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] or times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median (first-step costs)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--separate", action="store_true",
                        help="each side in a process of its own, one after the other (the trainer as the node "
                             "launches it; the ratio then carries the machine's drift between the runs)")
    parser.add_argument("--spec", type=Path, default=None, help="a prepared run spec (default: the tiny SD1.5)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ingraph-step-losses"))
    parser.add_argument("--bare", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--interleaved", type=Path, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.bare:
        print(json.dumps(bare_loop(opts.bare)))
        return
    if opts.interleaved:
        print(json.dumps(interleaved_run(opts.interleaved)))
        return
    spec = bench_spec(opts.work, opts.steps, opts.spec)
    if opts.separate:
        ours, bare = [], []
        for _ in range(opts.repeats):
            ours.append(steady(trainer_step_times(spec), opts.warmup))
            bare.append(steady(bare_step_times(spec), opts.warmup))
            print(f"trainer {ours[-1]:.4f} s/step, bare loop {bare[-1]:.4f} s/step", flush=True)
        print(f"trainer s/step {min(ours):.4f}")
        print(f"bare PyTorch s/step {min(bare):.4f}")
        print(f"ratio {min(ours) / min(bare):.3f}")
        return
    ours, bare, paired = [], [], []
    for _ in range(opts.repeats):
        run_ours, run_bare = (times[opts.warmup:] for times in interleaved_step_times(spec))
        if len(run_ours) != len(run_bare) or not run_ours:
            sys.exit(f"{len(run_ours)} trainer steps against {len(run_bare)} bare ones: nothing to compare")
        ours += run_ours
        bare += run_bare
        paired += [a / b for a, b in zip(run_ours, run_bare)]
        print(f"trainer {statistics.median(run_ours):.4f} s/step, bare loop {statistics.median(run_bare):.4f} "
              f"s/step, median of the steps' ratios {statistics.median(paired[-len(run_ours):]):.3f}", flush=True)
    print(f"trainer s/step {statistics.median(ours):.4f}")
    print(f"bare PyTorch s/step {statistics.median(bare):.4f}")
    print(f"ratio {statistics.median(paired):.3f} (the median over the {len(paired)} steps of each trainer step "
          "against the bare step beside it)")

if __name__ == "__main__":
    main()
