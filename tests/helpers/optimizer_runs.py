"""Trains every optimizer 3 steps and resumes each from its step-2 checkpoint, in this one process, through the
trainer's own Trainer (build, train loop, Checkpointer, export): what `python trainer --config` runs, without a
process start (~12 s of imports) per run. Used by tests/trainer/test_ema_optimizers.py.

    python tests/helpers/optimizer_runs.py BASE_SPEC OUT_DIR OPTIMIZER[:ema] ...

`:ema`: that run keeps an EMA (decay 0.5 from step 1) and saves it as the file. Prints one JSON line:
{optimizer: {"first": [events], "resumed": [events], "first_file": hex digest, "resumed_file": hex digest}}.
"""
from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.prepare_run import _bootstrap  # noqa: E402  (the pack as the package ingraph_trainer)

_bootstrap()

from ingraph_trainer.trainer.spec import load_run_spec  # noqa: E402
from ingraph_trainer.trainer.run.events import EVENTS_FILE, EventWriter, read_events  # noqa: E402
from ingraph_trainer.trainer.tasks.loop import Trainer  # noqa: E402


def tensors_digest(path: Path) -> str:
    """Of the tensors only: the metadata carries the run's times."""
    from safetensors.torch import load_file
    digest = hashlib.sha256()
    tensors = load_file(path)
    for key in sorted(tensors):
        digest.update(key.encode() + tensors[key].contiguous().view(-1).view(dtype=__import__("torch").uint8)
                      .numpy().tobytes())
    return digest.hexdigest()


def train(spec) -> list[dict]:
    events_path = Path(spec.run_dir) / EVENTS_FILE
    seen = len(read_events(events_path)) if events_path.exists() else 0
    events = EventWriter(events_path)
    try:
        Trainer(spec, events).run()
    finally:
        events.close()
    return read_events(events_path)[seen:]


def main(argv):
    base, out, runs = load_run_spec(argv[0]), Path(argv[1]), argv[2:]
    results = {}
    for run in runs:
        optimizer, _, ema = run.partition(":")
        spec = copy.deepcopy(base)
        run_dir = out / run.replace(":", "_")
        run_dir.mkdir(parents=True)
        spec.run_dir, spec.output.lora_path = str(run_dir), str(run_dir / "adapter.safetensors")
        spec.train.optimizer, spec.train.steps, spec.train.save_every = optimizer, 3, 2
        spec.train.learning_rate = 1.0 if optimizer == "prodigy" else 1e-3  # Prodigy's lr scales its estimate
        if ema:
            spec.train.ema_decay, spec.train.ema_start_step, spec.output.weights = 0.5, 1, "ema"
            spec.train.eval_before = True  # the test compares the average with the weights at step 0
        spec.validate(f"{optimizer} run")
        first = train(spec)
        first_file = tensors_digest(Path(spec.output.lora_path))
        spec.train.resume = "latest"  # the step-2 checkpoint (the last step is never saved)
        resumed = train(spec)
        results[run] = {"first": first, "resumed": resumed, "first_file": first_file,
                        "resumed_file": tensors_digest(Path(spec.output.lora_path)),
                        "lora_path": spec.output.lora_path}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
