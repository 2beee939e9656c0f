"""Samples per second of the trainer on the tiny model: 1 process vs 2 processes (data parallel), and 1 vs 2
pipeline stages (the UNet split across 2 processes), gloo on CPU.

Same global batch per optimizer step in every layout (1 process: micro-batch b with gradient accumulation 2;
2 processes: micro-batch b each; 2 stages: micro-batch b, accumulation 2, one pipeline). On a 2-core CPU this
measures overhead, not speed-up.

    python bench/scaling.py [--steps 30 --batch 2]
The last line holds the ratios against 1 process (= 1 stage).
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
sys.path.insert(0, str(REPO))


def run(spec: Path, processes: int) -> float:
    import types
    if "ingraph_trainer" not in sys.modules:
        pkg = types.ModuleType("ingraph_trainer")
        pkg.__path__ = [str(REPO)]
        sys.modules["ingraph_trainer"] = pkg
    from ingraph_trainer.runner.launcher import deepspeed_launch_command
    trainer = str(REPO / "trainer" / "__main__.py")
    cmd = ([*deepspeed_launch_command(sys.executable, processes), trainer] if processes > 1
           else [sys.executable, trainer]) + ["--config", str(spec)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=spec.parent, timeout=1800)
    events = [json.loads(line) for line in (spec.parent / "events.jsonl").read_text().splitlines()]
    rates = [e["samples_per_s"] for e in events if e["type"] == "step"][3:]
    return statistics.median(rates)


def main(argv=None):
    from tools.embedded_default import build_checkpoint, build_images
    from tools.prepare_run import prepare
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=2)
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ingraph-scaling-") as tmp:
        tmp = Path(tmp)
        ckpt = build_checkpoint(tmp / "tiny.safetensors")
        build_images(tmp / "images", count=8, size=64)
        common = {"train.steps": opts.steps, "train.batch_size": opts.batch, "train.precision": "fp32",
                  "train.eval_quantiles": [0.5]}
        one = prepare(ckpt, tmp / "images", tmp / "one", {**common, "train.grad_accum": 2})
        two = prepare(ckpt, tmp / "images", tmp / "two", {**common, "distributed.processes": 2})
        staged = prepare(ckpt, tmp / "images", tmp / "staged", {**common, "train.grad_accum": 2,
                                                                 "distributed.processes": 2,
                                                                 "distributed.pipeline_stages": 2})
        r1, r2, rp = run(one, 1), run(two, 2), run(staged, 2)
    print(f"tiny SD1.5, fp32, global batch {2 * opts.batch} per step, {opts.steps} steps, CPU, gloo")
    print(f"1 process (micro-batch {opts.batch} x accumulation 2): {r1:.2f} samples/s")
    print(f"2 processes (micro-batch {opts.batch} each):             {r2:.2f} samples/s")
    print(f"2 pipeline stages (micro-batch {opts.batch} x accumulation 2): {rp:.2f} samples/s")
    print(f"ratios: 2 processes / 1 process {r2 / r1:.3f}; 2 stages / 1 stage {rp / r1:.3f}")


if __name__ == "__main__":
    main()
