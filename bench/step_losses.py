"""The numbers of a fixed 5-step fp32 run, printed exactly (float hex), to show a change to the trainer leaves
its arithmetic alone: step losses, gradient norms, evaluation losses and the adapter's digest.

    python bench/step_losses.py [--work /tmp/ingraph-step-losses] > before.txt
    ... change the trainer ...
    python bench/step_losses.py > after.txt && diff before.txt after.txt

The tiny SD1.5 checkpoint, its images, cache and materialised model are built once in --work; every
invocation trains a fresh copy of the same run spec (the trainer program, one process, as the tests launch it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETTINGS = {"train.steps": 5, "train.batch_size": 2, "train.grad_accum": 2, "train.precision": "fp32",
            "train.seed": 3, "train.lr_schedule": "linear", "train.warmup_steps": 1, "train.learning_rate": 1e-3,
            "train.eval_quantiles": [0.3, 0.7], "adapter.rank": 4, "adapter.dropout": 0.1}


def prepared_spec(work: Path) -> Path:
    spec = work / "base" / "run.toml"
    if spec.is_file():
        return spec
    assets = work / "assets"
    subprocess.run([sys.executable, str(REPO / "tools" / "embedded_default.py"), "--checkpoint",
                    str(assets / "tiny.safetensors"), "--images", str(assets / "images")], check=True,
                   capture_output=True)
    args = [sys.executable, str(REPO / "tools" / "prepare_run.py"), "--checkpoint", str(assets / "tiny.safetensors"),
            "--images", str(assets / "images"), "--run-dir", str(work / "base")]
    for key, value in SETTINGS.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    subprocess.run(args, check=True, capture_output=True)
    return spec


def fresh_run(base_spec: Path, run_dir: Path) -> Path:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    text = base_spec.read_text().replace(str(base_spec.parent), str(run_dir))
    (run_dir / "run.toml").write_text(text)
    shutil.copy(base_spec.parent / "dataset.json", run_dir / "dataset.json")
    return run_dir / "run.toml"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ingraph-step-losses"))
    opts = parser.parse_args(argv)
    spec = fresh_run(prepared_spec(opts.work), opts.work / "run")
    proc = subprocess.run([sys.executable, str(REPO / "trainer"), "--config", str(spec)], capture_output=True,
                          text=True, cwd=spec.parent)
    if proc.returncode:
        sys.exit(f"trainer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (spec.parent / "events.jsonl").read_text().splitlines()]
    for e in events:
        if e["type"] == "step":
            print(f"step {e['step']} loss {float(e['loss']).hex()} grad_norm {float(e['grad_norm']).hex()}")
        elif e["type"] == "eval":
            print(f"eval {e['step']} loss {float(e['loss']).hex()}")
    from safetensors.torch import load_file  # the tensors only: the metadata carries the run's times
    tensors = load_file(spec.parent / "lora.safetensors")
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode() + tensors[key].contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    print("adapter tensors sha256", digest.hexdigest())


if __name__ == "__main__":
    main()
