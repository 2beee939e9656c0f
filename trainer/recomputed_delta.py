"""LoHa's and LoKr's weight change made again in the backward pass instead of kept from the forward one.

peft's LoHa and LoKr layers build each adapted layer's whole weight change dW (a Hadamard or Kronecker product of
small factors) and hand it to the matmul, which saves dW for the backward pass: a weight's bytes per adapted layer,
alive from the forward pass to the backward one (SDXL LoKr on all linear layers: 4.6 GB beside a 4.8 GB base, where
LoRA holds 0.1). Here dW is built without autograd in the forward pass and dropped; the backward pass builds it once
more (from the factors, as cheap as the forward's) for the input's gradient and the factors' gradients, which come
out as peft's own: the same operations, one product done twice. LyCORIS-based trainers hold no dW either.

Linear and 2-D convolution layers (zero padding given as numbers), and not with rank dropout (its random rows would be
drawn again): the others keep peft's path. Not under ZeRO-3 either, which gathers a layer's parameters around its own
forward and backward hooks only. A hook registered on a factor with Tensor.register_hook runs twice a backward pass
(once inside this backward's own autograd.grad); post-accumulate hooks, which DeepSpeed's ZeRO-1/2 use, run once.
"""
from __future__ import annotations

import types

import torch


def _factors(layer) -> list:
    """The layer's trained tensors, dW's inputs: the Function's inputs and, in its backward, what dW is made from."""
    return [p for p in layer.parameters() if p.requires_grad]


def _convolution(layer) -> tuple | None:
    """A 2-D convolution's (stride, padding, dilation, groups), or None for a linear layer."""
    base = layer.get_base_layer()
    if not isinstance(base, torch.nn.Conv2d):
        return None
    return tuple(base.stride), tuple(base.padding), tuple(base.dilation), base.groups


class _ChangeRecomputed(torch.autograd.Function):
    """F.linear(x, dW) (or F.conv2d) for `layer`'s adapter, dW made by `layer.get_delta_weight` here and again in
    backward; `params`: the layer's trained tensors (dW's inputs), given so that their gradients are returned."""

    @staticmethod
    def forward(ctx, x, layer, adapter, *params):
        with torch.no_grad():
            change = layer.get_delta_weight(adapter)
            x_cast = layer._cast_input_dtype(x, change.dtype)  # peft's own cast, so the same product
        ctx.layer, ctx.adapter, ctx.x_dtype, ctx.conv = layer, adapter, x.dtype, _convolution(layer)
        ctx.save_for_backward(x_cast, *params)
        if ctx.conv is None:
            return torch.nn.functional.linear(x_cast, change)
        stride, padding, dilation, groups = ctx.conv
        return torch.nn.functional.conv2d(x_cast, change, None, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad_out):
        x_cast, *_ = ctx.saved_tensors  # the factors are saved for autograd's check that none changed in place
        params = _factors(ctx.layer)  # its own: under checkpointing the saved ones come back as detached copies
        with torch.enable_grad():
            change = ctx.layer.get_delta_weight(ctx.adapter)
        # under autocast the forward's product ran in its lower precision, and this backward runs without it: the
        # change comes back in the factors' dtype, and the input and the incoming gradient are cast to it
        grad_out, x_cast = grad_out.to(change.dtype), x_cast.to(change.dtype)
        grad_x = grad_change = None
        wants_x, wants_change = ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:])
        if ctx.conv is not None:  # the convolution's own backward, as autograd runs it
            stride, padding, dilation, groups = ctx.conv
            grad_x, grad_change, _ = torch.ops.aten.convolution_backward(
                grad_out, x_cast, change.detach(), None, stride, padding, dilation, False, [0] * len(stride), groups,
                [wants_x, wants_change, False])
            grad_x = grad_x.to(ctx.x_dtype) if wants_x else None
        else:
            if wants_x:
                grad_x = grad_out.matmul(change.detach()).to(ctx.x_dtype)
            if wants_change:
                grad_change = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(
                    x_cast.reshape(-1, x_cast.shape[-1]))
        if wants_change:
            grads = torch.autograd.grad(change, params, grad_change.to(change.dtype), allow_unused=True)
        else:
            grads = (None,) * len(params)
        return (grad_x, None, None, *grads)


def _delta_activations(layer, adapter_name, input, *args, **kwargs):
    """peft's _get_delta_activations, bound to each layer (a deep copy of the model binds to its copy)."""
    params = _factors(layer)
    if not torch.is_grad_enabled() or not params:  # evaluation, previews: nothing is kept in any case
        return type(layer)._get_delta_activations(layer, adapter_name, input, *args, **kwargs)
    return _ChangeRecomputed.apply(input, layer, adapter_name, *params)


def recompute_weight_changes(model: torch.nn.Module) -> int:
    """Every peft LoHa or LoKr Linear or Conv2d layer of `model` without rank dropout makes its weight change again
    in the backward pass instead of keeping it. Returns the number of layers changed."""
    from peft.tuners.loha.layer import Conv2d as LoHaConv2d, Linear as LoHaLinear
    from peft.tuners.lokr.layer import Conv2d as LoKrConv2d, Linear as LoKrLinear
    changed = 0
    for layer in model.modules():
        if not isinstance(layer, (LoHaLinear, LoKrLinear, LoHaConv2d, LoKrConv2d)) or any(layer.rank_dropout.values()):
            continue
        base = layer.get_base_layer()
        if isinstance(base, torch.nn.Conv2d) and (isinstance(base.padding, str) or base.padding_mode != "zeros"):
            continue
        layer._get_delta_activations = types.MethodType(_delta_activations, layer)
        changed += 1
    return changed
