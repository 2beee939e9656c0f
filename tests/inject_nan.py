"""The trainer program with its training loss turned to NaN at one step (INGRAPH_NAN_AT_STEP): the real
divergence check, triggered on purpose. Evaluation passes (no gradients) are left alone."""
import os
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
package = types.ModuleType("ingraph_trainer")
package.__path__ = [str(REPO)]
sys.modules["ingraph_trainer"] = package

import torch  # noqa: E402

from ingraph_trainer.trainer import training_module  # noqa: E402
from ingraph_trainer.trainer.main import main  # noqa: E402

NAN_AT_STEP = int(os.environ["INGRAPH_NAN_AT_STEP"])
training_forward = training_module.TrainingModule.forward
calls = {"n": 0}


def forward(self, *args, **kwargs):
    loss = training_forward(self, *args, **kwargs)
    if torch.is_grad_enabled():
        calls["n"] += 1  # one micro-batch per step in the test's spec
        if calls["n"] == NAN_AT_STEP:
            return loss * float("nan")
    return loss


training_module.TrainingModule.forward = forward
sys.exit(main())
