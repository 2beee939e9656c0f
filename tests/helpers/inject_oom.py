"""The trainer program with the device running out of memory in one step's forward (INGRAPH_OOM_AT_STEP): the
out-of-memory error a full card gives, raised on purpose on a CPU. Evaluation passes (no gradients) are left alone.

    run_trainer(spec, patch="inject_oom", env={"INGRAPH_OOM_AT_STEP": "3"})    (conftest)
"""
import os


def install():
    """Patches the training forward of this process's trainer (the pack imported as ingraph_trainer)."""
    import torch

    from ingraph_trainer.trainer import training_module
    oom_at_step = int(os.environ["INGRAPH_OOM_AT_STEP"])
    training_forward = training_module.TrainingModule.forward
    calls = {"n": 0}

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            calls["n"] += 1  # one micro-batch per step in the test's spec
            if calls["n"] == oom_at_step:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return training_forward(self, *args, **kwargs)
    training_module.TrainingModule.forward = forward
