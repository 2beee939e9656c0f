"""Backward passes for comfy-kitchen's fused rotary-embedding ops (ComfyUI 0.33's `comfy_kitchen`), which have none.

Some of ComfyUI 0.33's models (JoyImage, Cosmos Predict2 and Anima, ...) call comfy-kitchen's fused RMS-norm-and-
rotary ops whether or not ComfyUI is training (its `model_management.in_training` switches only some models to plain
torch), and autograd cannot go back through a custom op with no formula ("Trying to backward through
comfy_kitchen.rms_rope.default but no autograd formula was registered"). Here each such op gets one: its forward
stays comfy-kitchen's kernel, and its backward computes the op again with comfy-kitchen's own eager implementation
(plain torch) and differentiates that, so the gradients are those of the eager implementation."""
from __future__ import annotations

import functools

# comfy-kitchen's out-of-place rotary ops (the in-place ones write into their inputs, which no trained path does)
OPS = ("apply_rope", "apply_rope1", "apply_rope_split_half", "apply_rope_split_half1", "rms_rope", "rms_rope1",
       "rms_rope_split_half", "rms_rope_split_half1")


@functools.cache
def register_backwards() -> tuple[str, ...]:
    """Gives each op of OPS that this comfy-kitchen defines, and that has no backward of its own, the eager
    implementation's backward (once per process); returns the names of those it gave one (none without
    comfy-kitchen: ComfyUI 0.3.64)."""
    import torch
    try:
        from comfy_kitchen.backends.eager import rope as eager
    except ImportError:
        return ()
    given = []
    for name in OPS:
        reference = getattr(eager, name, None)
        if reference is None or not hasattr(torch.ops.comfy_kitchen, name) or _has_backward(f"comfy_kitchen::{name}"):
            continue
        torch.library.register_autograd(f"comfy_kitchen::{name}", _backward_of(reference), setup_context=_keep_inputs)
        given.append(name)
    return tuple(given)


def _has_backward(qualname: str) -> bool:
    """Whether the custom op already has a backward (a comfy-kitchen that defines its own keeps it: registering
    replaces one silently). Read from torch's custom-op record; a torch without it is taken as none."""
    try:
        from torch._library.custom_ops import _maybe_get_opdef
        return getattr(_maybe_get_opdef(qualname), "_backward_fn", None) is not None
    except (ImportError, AttributeError):
        return False


def _keep_inputs(ctx, inputs, output):
    import torch
    ctx.others = [None if isinstance(x, torch.Tensor) else x for x in inputs]
    ctx.save_for_backward(*(x if isinstance(x, torch.Tensor) else None for x in inputs))


def _backward_of(reference):
    def backward(ctx, *grads):
        import torch
        inputs = [t if t is not None else other for t, other in zip(ctx.saved_tensors, ctx.others)]
        wanted = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and ctx.needs_input_grad[i]]
        result = [None] * len(inputs)
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True) if i in wanted else x for i, x in enumerate(inputs)]
            outputs = reference(*leaves)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            # autograd hands a (zero) gradient for every output: only those computed from an input wanted count
            pairs = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None and out.requires_grad]
            if not wanted or not pairs:
                return tuple(result)
            found = torch.autograd.grad([out for out, _ in pairs], [leaves[i] for i in wanted],
                                        [grad for _, grad in pairs], allow_unused=True)
        for i, grad in zip(wanted, found):
            result[i] = grad
        return tuple(result)
    return backward
