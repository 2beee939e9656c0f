"""Inputs that the training nodes (Train LoRA, Distill) declare alike, defined once. Each keeps its name, default
and place in the node's list (saved workflows map widget values by position); a node adds its own note to the
shared tooltip where its run differs."""
from comfy_api.latest import io

from ..trainer.spec import PRECISION_CHOICES, choice_labels


def precision_input():
    return io.Combo.Input("precision", options=choice_labels(PRECISION_CHOICES), default="bf16",
                          tooltip="bf16: half the memory, faster on most GPUs; fp32: exact, reproducible; auto: "
                                  "bf16 where the GPU has it, else fp16; fp16: for GPUs without bf16 (RTX 20xx "
                                  "and older), with dynamic loss scaling.")


def output_file_inputs(overwrite_note: str = "", checkpoint_note: str = "") -> list:
    """overwrite and keep_last (in this order): what happens to a foreign file of the output's name, and how many
    resumable checkpoints stay on disk."""
    return [
        io.Boolean.Input("overwrite", default=False, optional=True,
                         tooltip="Replace a file of the same name in models/loras (or diffusion_models) that InGraph "
                                 "Trainer did not write, such as a LoRA you downloaded. Off: such a file is never "
                                 "touched and the run is refused before it starts." + overwrite_note),
        io.Int.Input("keep_last", default=3, min=0, max=10_000, optional=True,
                     tooltip="Resumable checkpoints kept on disk: older ones are deleted as new ones are saved "
                             "(0 = keep all)." + checkpoint_note),
    ]
