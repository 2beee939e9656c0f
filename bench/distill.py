"""Distillation's cost: seconds per distillation iteration (one generator update with its fake-score updates)
against seconds per step of adapter training on the same model, and peak memory per process of a 2-process
distillation without and with ZeRO-3; the ratio of the two times on the last line.

The model is the New Model builder's SD3 at a chosen size (default "small", ~50M parameters, so that three copies
and two optimizers are more than the process's own baseline; its text widths those of the synthetic text encoder
of tools/distill_quality.py), on that tool's synthetic dataset (64x64 images, 16x8x8 latents). The student and the
adapter are the same kind (default full), at the same batch size, precision and optimizer; each time is the median
of the steady steps' step_time_s (the first `--warmup` left out) from the trainer program's own events. Memory is the
`finished` event's peak_rss_per_rank (each process's VmHWM), on CPU over gloo.

    python bench/distill.py [--size small --kind full --steps 8 --warmup 2 --batch 4 --fake-updates 5 --threads 0]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the real score with guidance, as a distillation of a real model runs (two teacher passes an iteration); the quality
# check distils at CFG 1, which costs one
BENCH_CFG = 2.0
sys.path.insert(0, str(REPO))


def run_program(spec: Path, processes: int, threads: int = 0) -> list[dict]:
    from ingraph_trainer.runner.launcher import deepspeed_launch_command
    trainer = str(REPO / "trainer" / "__main__.py")
    cmd = ([*deepspeed_launch_command(sys.executable, processes), trainer] if processes > 1
           else [sys.executable, trainer]) + ["--config", str(spec)]
    import os
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=spec.parent, timeout=3600, env=env)
    events = [json.loads(line) for line in (spec.parent / "events.jsonl").read_text().splitlines() if line.strip()]
    if not any(e["type"] == "finished" for e in events):
        sys.exit(f"{spec} ({processes} process(es)) did not finish (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return events


def steady_step_s(events: list[dict], warmup: int) -> float:
    times = [e["step_time_s"] for e in events if e["type"] == "step"]
    return statistics.median(times[warmup:] or times)


def peak_rss(events: list[dict]) -> list:
    finished = next(e for e in events if e["type"] == "finished")
    return finished.get("peak_rss_per_rank") or [None]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="the SD3 New Model size (tiny, small, medium)")
    parser.add_argument("--kind", default="full", choices=["full", "lora"], help="the student's and the adapter's")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--fake-updates", type=int, default=5)
    parser.add_argument("--student-steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0,
                        help="OMP_NUM_THREADS of the 1-process runs (0: torch's default, every core; 2 processes "
                             "take cores / 2 each, as the trainer sets them)")
    opts = parser.parse_args(argv)
    from tools.bootstrap import bootstrap
    bootstrap()
    from ingraph_trainer.trainer.models import SCRATCH_FAMILIES
    from tools import distill_quality as dq
    from tools.tiny_models import _save
    sd3 = SCRATCH_FAMILIES["sd3"]
    size = sd3.scratch_size_for_text(sd3.scratch_sizes[opts.size], 64, 32)  # the synthetic encoder's widths
    with tempfile.TemporaryDirectory(prefix="ingraph-distill-bench-") as tmp:
        work = Path(tmp)
        dataset = dq.build_dataset(work, per_caption=4, caption_dropout=0.2)
        model = work / f"sd3_{opts.size}.safetensors"
        _save(sd3.scratch_state_dict(0, **size), model)
        params = sum(v.numel() for v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            str(model)).values())
        common = {"train.precision": "fp32", "train.eval_quantiles": [0.5], "train.batch_size": opts.batch,
                  "train.steps": opts.steps, "adapter.kind": opts.kind, "adapter.rank": 16,
                  "adapter.targets": "attention_ff"}
        distill = {**common, "distill.fake_updates": opts.fake_updates, "distill.student_steps": opts.student_steps,
                   "distill.guidance_scale": BENCH_CFG}
        train_events = run_program(dq.write_run(work, "train", model, dataset, common), 1, opts.threads)
        one = run_program(dq.write_run(work, "distill1", model, dataset, distill, task="distill"), 1,
                          opts.threads)
        layouts = {}
        for stage in (0, 3):
            spec = dq.write_run(work, f"distill_zero{stage}", model, dataset,
                                {**distill, "distributed.processes": 2, "distributed.zero_stage": stage},
                                task="distill")
            layouts[stage] = run_program(spec, 2)
    train_s, distill_s = steady_step_s(train_events, opts.warmup), steady_step_s(one, opts.warmup)
    gib = 1024 ** 3
    print(f"SD3 {opts.size} ({params / 1e6:.1f}M parameters), {opts.kind}, fp32, batch {opts.batch}, CPU; "
          f"distillation: {opts.student_steps}-step student, {opts.fake_updates} fake-score updates per iteration, "
          f"teacher CFG {BENCH_CFG}")
    print(f"adapter training, 1 process:     {train_s:.3f} s/step")
    print(f"distillation, 1 process:         {distill_s:.3f} s/iteration")
    print(f"peak RSS per rank, 1 process:    {', '.join(f'{b / gib:.2f} GiB' for b in peak_rss(one))}")
    for stage, events in layouts.items():
        print(f"peak RSS per rank, 2 processes, ZeRO-{stage}: "
              f"{', '.join(f'{b / gib:.2f} GiB' if b else 'n/a' for b in peak_rss(events))} "
              f"({steady_step_s(events, opts.warmup):.3f} s/iteration)")
    print(f"ratio: distillation s/iteration / adapter training s/step = {distill_s / train_s:.2f}")


if __name__ == "__main__":
    main()
