"""The pieces each family's pipeline layers share (ModelFamily.pipeline_layers): the first layer's turn of the stage
inputs into what the model's blocks take, and the last layer's hold on tensors it carried but no longer needs."""
from __future__ import annotations

import torch

from .base import Batch


class StageInput(torch.nn.Module):
    """A family's first pipeline layer: stage inputs (latents, cond, noise, timesteps[, pooled]) to what the
    model's blocks take. The family is kept out of the submodules: its model is split across the layers."""

    def __init__(self, family):
        super().__init__()
        self._family = [family]

    @property
    def family(self):
        return self._family[0]

    def model_inputs(self, inputs):
        latents, cond, noise, timesteps, *pooled = inputs
        return self.family.model_inputs(Batch(latents, cond, pooled[0] if pooled else None, noise, timesteps))

    @staticmethod
    def sendable(*tensors):
        """DeepSpeed sends a gradient back for every floating-point tensor that crosses a stage."""
        for tensor in tensors:
            tensor.requires_grad_(True)
        return tensors


def ends_here(output: torch.Tensor, *carried: torch.Tensor) -> torch.Tensor:
    """The last layer's output, with a zero-weighted use of tensors carried along but not needed any more, so
    that they get the (zero) gradient DeepSpeed sends back across stages."""
    return output + sum((t * 0).sum() for t in carried)  # each element zeroed first: a mask's -3.4e38s sum to -inf

