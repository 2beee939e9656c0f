"""The trainer program with its training loss turned to NaN at one step (INGRAPH_NAN_AT_STEP): the real
divergence check, triggered on purpose. Evaluation passes (no gradients) are left alone.

    INGRAPH_NAN_AT_STEP=3 python tests/helpers/inject_nan.py --config SPEC    the program, patched
    run_trainer(spec, patch="inject_nan", env={"INGRAPH_NAN_AT_STEP": "3"})    the same, forked (conftest)
"""
import os
import sys
import types
from pathlib import Path


def install():
    """Patches the training forward of this process's trainer (the pack imported as ingraph_trainer)."""
    import torch

    from ingraph_trainer.trainer import training_module
    nan_at_step = int(os.environ["INGRAPH_NAN_AT_STEP"])
    training_forward = training_module.TrainingModule.forward
    calls = {"n": 0}

    def forward(self, *args, **kwargs):
        loss = training_forward(self, *args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1  # one micro-batch per step in the test's spec
            if calls["n"] == nan_at_step:
                return loss * float("nan")
        return loss
    training_module.TrainingModule.forward = forward


if __name__ == "__main__":
    REPO = Path(__file__).resolve().parents[2]
    package = types.ModuleType("ingraph_trainer")
    package.__path__ = [str(REPO)]
    sys.modules["ingraph_trainer"] = package
    install()
    from ingraph_trainer.trainer.main import main
    sys.exit(main())
