"""Residual adds out of place in ComfyUI's blocks: its inference code adds residuals in place into tensors that
autograd saved for the backward pass; the families whose blocks do so (Flux's, HunyuanVideo's,
LTX-Video's, the generic family's Flux-style blocks) wrap them."""
from __future__ import annotations

import torch


class _OutOfPlaceAdd(torch.Tensor):
    """`x += y` makes a new tensor: ComfyUI's inference code adds residuals in place into tensors a norm layer
    saved for the backward pass, which autograd refuses. Everything else behaves as a plain tensor."""

    def __iadd__(self, other):
        return _residual(torch.add(self, other))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # ComfyUI 0.33's LTX-Video block normalises its residual and then adds into that same tensor in place
        # (x.addcmul_), a call __iadd__ cannot see: the norm gets a copy of the residual to save, so the add changes
        # nothing it saved. Only the residual stream (the block's input, each sum __iadd__ made): tensors computed
        # from it are of this class too (a query a norm normalises, say), and copying those would cost memory
        if func in _NORMS and args and getattr(args[0], "_ingraph_residual", False) and args[0].requires_grad \
                and torch.is_grad_enabled():
            args = (args[0].clone(), *args[1:])
        return super().__torch_function__(func, types, args, kwargs)


def _residual(tensor: torch.Tensor) -> torch.Tensor:
    tensor._ingraph_residual = True
    return tensor


_NORMS = {torch.nn.functional.rms_norm, torch.rms_norm}


def residuals_out_of_place(blocks, copy_inputs: bool = False) -> None:
    """Wraps each block so the tensors it receives add out of place, and hands plain tensors back. `copy_inputs`:
    for blocks that add into their inputs in place before any `+=` (LTX-2's, into a (video, audio) pair), every
    floating tensor they receive, in tuples too, is a copy, so their caller's (and a checkpoint's recompute's)
    input stays as it was."""
    def plain(value):
        if isinstance(value, _OutOfPlaceAdd):
            return value.as_subclass(torch.Tensor)
        if isinstance(value, (tuple, list)):
            return type(value)(plain(v) for v in value)
        return value

    def residual(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return _residual((value.clone() if copy_inputs else value).as_subclass(_OutOfPlaceAdd))
        if copy_inputs and isinstance(value, tuple):
            return tuple(residual(v) for v in value)
        return value

    for block in blocks:
        if getattr(block, "_ingraph_out_of_place", False):  # wrapped already: one shim per block
            continue
        forward = block.forward

        def wrapped(*args, _forward=forward, **kwargs):
            args = tuple(residual(a) for a in args)
            kwargs = {k: residual(v) if k in ("img", "txt", "x") else v for k, v in kwargs.items()}
            return plain(_forward(*args, **kwargs))
        block.forward = wrapped
        block._ingraph_out_of_place = True
