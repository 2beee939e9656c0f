"""Pipeline layers run in one process as DeepSpeed's pipeline engine runs them with a stage boundary after every
layer: the engine sends tensors only; the next stage receives each floating-point one as a leaf that requires grad;
backward runs stage by stage, each stage's floating-point outputs given the gradients the next stage sends back
(torch.autograd.backward, which fails on an output that requires no grad), and the engine asserts that every
floating-point tensor it received has a gradient to send on. A stage holds (places on its device, and optimises)
the parameters its layers register, so every weight a layer computes with must be one of its own."""
from __future__ import annotations

import torch

DEEPSPEED_TENSOR_META_SIZE = 256  # deepspeed/runtime/pipe/engine.py: TENSOR_META_SIZE


def losses_through_stages(family, batch, layers):
    """The per-sample losses of `batch` through `layers`, a stage boundary after every layer, its first inputs as the
    engine is given them (pipeline.micro_batch: reference images included); with [(what a layer sent, what the next
    received)] per boundary."""
    from ingraph_trainer.trainer.parallel.pipeline import ContiguousOutputs, micro_batch
    x, _ = micro_batch(batch.latents, batch.cond, batch.noise, batch.timesteps, batch.pooled, batch.references)
    boundaries = []
    for n, layer in enumerate(map(ContiguousOutputs, layers)):  # as pipeline.build wraps them
        if n:
            assert isinstance(x, tuple) and all(isinstance(t, torch.Tensor) for t in x), \
                (type(layer).__name__, [type(t).__name__ for t in x] if isinstance(x, tuple) else type(x))
            meta = 2 + sum(2 + t.ndim for t in x)  # the engine describes a tuple in one 256-int message
            assert meta <= DEEPSPEED_TENSOR_META_SIZE, f"{type(layer).__name__} receives {meta} ints of shapes"
            received = tuple(t.detach().clone(memory_format=torch.contiguous_format)
                             .requires_grad_(t.is_floating_point()) for t in x)
            boundaries.append((x, received))
            x = received
        x = layer(x)
    assert isinstance(x, torch.Tensor), type(x)  # the last stage's output goes to the loss
    return family.loss_of_output(x, batch.latents, batch.noise, batch.timesteps, reduce=False), boundaries


def assert_stages_compute_the_models_loss(family, batch) -> None:
    """Through stage boundaries the pipeline layers give the model's own per-sample loss (to 1e-6), backward
    crosses every boundary as the engine's does, and each layer computes with its own weights only (and no weight
    is held by two layers). The family's text_input_layer, where it names one, reads the width of the batch's text,
    and its pooled_input_layer that of the batch's pooled vector where the model takes one (the start-up check's:
    trainer.data.dataset_checks.text_width, pooled_width)."""
    from ingraph_trainer.trainer.data.dataset_checks import pooled_width, text_width
    if family.text_input_layer:  # the start-up check reads the text width this model takes where this batch runs
        assert text_width(family) == batch.cond.shape[-1], (family.name, text_width(family), batch.cond.shape)
    model = family.diffusion_model
    if batch.pooled is not None and any(getattr(model, n, None) is not None for n in ("vector_in", "y_embedder")):
        assert pooled_width(family) == batch.pooled.shape[-1], (family.name, pooled_width(family), batch.pooled.shape)
    with torch.no_grad():
        expected = family.loss(batch, reduce=False)
    layers = family.pipeline_layers()
    weights = dict(family.diffusion_model.named_parameters())
    held = [id(w) for layer in layers for w in layer.parameters()]
    assert len(held) == len(set(held)), "a weight is held by two layers (two stages would place it)"
    flags = {name: w.requires_grad for name, w in weights.items()}
    for w in weights.values():
        w.requires_grad_(True).grad = None
    try:
        got, boundaries = losses_through_stages(family, batch, layers)
        assert boundaries
        # the same computation, but a tensor made contiguous to cross a stage (as the engine's buffers are) can round
        # a few elements otherwise in the next layer's kernels: seen at most 1.5e-7 relative on the losses
        torch.testing.assert_close(got.detach(), expected, rtol=1e-6, atol=0)
        stage_backward = [lambda: got.mean().backward()] + [
            (lambda sent=sent, received=received: _send_back(sent, received, n)) for n, (sent, received)
            in enumerate(boundaries, 1)][::-1]
        for layer, backward in zip(reversed(layers), stage_backward, strict=True):
            for w in weights.values():  # what this stage's backward reaches, whatever a later stage's reached
                w.grad = None
            backward()
            own = {id(w) for w in layer.parameters()}
            foreign = [name for name, w in weights.items() if w.grad is not None and id(w) not in own]
            assert not foreign, f"{type(layer).__name__} computes with weights it does not hold: {foreign[:5]}"
    finally:
        for name, w in weights.items():
            w.requires_grad_(flags[name]).grad = None


def _send_back(sent, received, n: int) -> None:
    """Backward of the stage before boundary n, given what the stage after it sends back."""
    floats = [(s, r) for s, r in zip(sent, received, strict=True) if r.is_floating_point()]
    missing = [(m, tuple(r.shape)) for m, (_, r) in enumerate(floats) if r.grad is None]
    assert not missing, f"boundary {n}: no gradient to send back for (position, shape) {missing}"
    torch.autograd.backward([s for s, _ in floats], [r.grad for _, r in floats])
