"""Pipeline stages (diffusion-pipe's design on DeepSpeed's PipelineModule): the family's layers split across
processes by trainable parameters, data parallel across pipelines.

Stage inputs are (latents, cond, noise, timesteps[, pooled][, reference images]); the labels are (latents, noise,
timesteps), from which the last stage computes the family's target, so the data order, noise and timesteps of a step are the
ones a single process draws. Evaluation runs through the stages too (no stage ever holds the whole model on
its device); the adapter is collected from the stages that trained each layer before it is written.
"""
from __future__ import annotations

import torch

from .distributed import world_size


class PipelineLoss:
    """The last stage's loss_fn: the training objective, or per-sample plain MSE while evaluating."""

    def __init__(self, family):
        self.family = family
        self.evaluating = False

    def __call__(self, output, labels):
        latents, noise, timesteps = labels
        return self.family.loss_of_output(output, latents, noise, timesteps, reduce=not self.evaluating,
                                          weighted=not self.evaluating)


class ContiguousOutputs(torch.nn.Module):
    """Point-to-point sends between stages need contiguous tensors; ComfyUI's blocks hand out transposed views."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, inputs):
        out = self.layer(inputs)
        return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()


def check_layout(stages: int):
    if world_size() % stages:
        raise ValueError(f"distributed.pipeline_stages: {stages} stages do not divide {world_size()} processes")


def check_data(data_spec, dataset, layers):
    """The stages pass (latents, cond, noise, timesteps[, pooled][, reference images]) and take the plain mean of
    the per-sample losses: sound (audio latents), loss masks and prior images (per-sample weights, their own loss in
    the events) do not pass through them, nor reference images where the family's first layer does not take them
    (StageInput.takes_references). Caption dropout and tag shuffling only change the text, and do."""
    from ..data.batch_mix import MixedDataset
    from ..data.dataset_checks import has_audio
    first = getattr(layers[0], "layer", layers[0])  # ContiguousOutputs' own
    if getattr(dataset, "reference_slots", 0) and not first.takes_references:
        raise ValueError(f"data.manifest: its items carry reference images, which {first.family.display_name}'s "
                         "pipeline stages (distributed.pipeline_stages > 1) do not pass on yet (Qwen-Image-Edit's, "
                         "Flux Kontext's and Flux.2's do); train with 1 stage")
    if has_audio(dataset):
        raise ValueError(f"data.manifest: {data_spec.manifest} has clips with sound (audio latents), which pipeline "
                         "stages (distributed.pipeline_stages > 1) do not pass on; train with 1 stage, or cache the "
                         "clips without an audio VAE to train the video alone")
    if data_spec.prior_manifest or isinstance(dataset, MixedDataset):
        raise ValueError("data.prior_manifest: prior images are not available with pipeline stages "
                         "(distributed.pipeline_stages > 1); train with 1 stage, or without prior images")
    if data_spec.masked_loss and any(dataset.masked):
        raise ValueError(f"data.masked_loss: {data_spec.manifest} has loss masks, which pipeline stages "
                         "(distributed.pipeline_stages > 1) cannot apply; set data.masked_loss to false (or the "
                         "dataset's masks to off), or train with 1 stage")


def build(family, stages: int):
    """(PipelineModule, its loss function, the layers in order)."""
    from deepspeed.pipe import PipelineModule
    check_layout(stages)
    layers = [ContiguousOutputs(layer) for layer in family.pipeline_layers()]
    loss = PipelineLoss(family)
    module = PipelineModule(layers=layers, num_stages=stages, loss_fn=loss, partition_method="parameters",
                            dynamic_shape=True)  # aspect-ratio buckets change activation shapes between steps
    idle = stages_training_nothing(layers, module.parts)
    if idle:  # every process knows the partition: all refuse alike, before an optimizer of nothing fails on one
        raise ValueError(f"distributed.pipeline_stages: stage {idle[0] + 1} of {stages} would train nothing "
                         f"(what this run trains lies in {sum(map(_trains, layers))} of {family.display_name}'s "
                         f"{len(layers)} pipeline layers); use fewer stages")
    return module, loss, layers


def receive_buffers_by_dtype(engine) -> None:
    """DeepSpeed's pipeline engine keeps one receive buffer per tuple position for activations and gradients alike
    (_grad_layer_buf), and reuses one large enough whatever its dtype. A stage between two others (3 stages or
    more) receives tuples whose tensor at a position is of another dtype than the gradient it gets back there
    (Flux.2's integer shape where a modulation's gradient returns; a bf16 vector where an fp32 rotary gradient
    does), and would receive into a view of the wrong dtype: here a position whose dtype changes gets a new buffer
    of the dtype asked for. Left as it is where a DeepSpeed version keeps its buffers otherwise."""
    if not (hasattr(engine, "_grad_layer_buf") and hasattr(engine, "_allocate_buffer")):
        return
    reuse = engine._allocate_or_extend_buffers

    def allocate(idx, shape, dtype):
        buffers = engine._grad_layer_buf
        if idx < len(buffers) and buffers[idx].dtype != dtype:
            buffers[idx] = engine._allocate_buffer(shape, dtype=dtype, num_buffers=1)[0]
            return buffers[idx]
        return reuse(idx, shape, dtype)
    engine._allocate_or_extend_buffers = allocate


def _trains(layer) -> bool:
    return any(p.requires_grad for p in layer.parameters())


def stages_training_nothing(layers, bounds) -> list[int]:
    """The stages whose layers (layers[bounds[s]:bounds[s + 1]]) hold no trained parameter."""
    return [s for s in range(len(bounds) - 1) if not any(map(_trains, layers[bounds[s]:bounds[s + 1]]))]


def micro_batch(latents, cond, noise, timesteps, pooled=None, references=None):
    """One micro-batch as the pipeline engine takes it: (stage inputs, labels). Reference images (edit models')
    follow the pooled vector, an empty tensor in its place where there is none (stages.StageInput reads them)."""
    inputs = (latents, cond, noise, timesteps)
    if pooled is not None or references:
        inputs += (pooled if pooled is not None else torch.empty(0), *(references or ()))
    return inputs, (latents, noise, timesteps)


def collect_parameters(engine, layers, trainable_only: bool):
    """Every process gets the weights each stage trained (broadcast from the stage that owns the layer),
    so rank 0 can write the whole adapter. Collective: every rank calls it."""
    module, grid = engine.module, engine.grid
    bounds = module.parts
    for index, layer in enumerate(layers):
        stage = next(s for s in range(module.num_stages) if bounds[s] <= index < bounds[s + 1])
        source = grid.stage_to_global(stage_id=stage, data=0)
        for param in layer.parameters():
            if trainable_only and not param.requires_grad:
                continue
            buffer = param.detach().to(engine.device).clone()
            torch.distributed.broadcast(buffer, src=source)
            with torch.no_grad():
                param.copy_(buffer.to(param.device))


def evaluate(engine, loss: PipelineLoss, dataset, indices, quantiles, seed: int, batch_size: int) -> dict:
    """The same numbers as evaluation.evaluate (fixed noise per image, fixed timestep quantiles), computed
    through the stages: each chunk is one micro-batch; the last stage's per-sample losses reach every rank."""
    from ..tasks.evaluation import eval_chunks, eval_noise, layout_independent_threads, summarise
    per_item = torch.zeros(len(quantiles), len(indices), dtype=torch.float64)
    position = {item: n for n, item in enumerate(indices)}
    last = engine.grid.stage_to_global(stage_id=engine.num_stages - 1)
    loss.evaluating = True
    try:
        with layout_independent_threads(engine.device):
            for chunk in eval_chunks(dataset, indices, batch_size):
                latents, cond, pooled = dataset.batch(chunk)
                references = dataset.references(chunk) if getattr(dataset, "reference_slots", 0) else None
                noise = eval_noise(latents.shape[1:], chunk, seed)
                for qn, q in enumerate(quantiles):
                    timesteps = torch.full((len(chunk),), float(q))
                    engine.total_loss = None  # eval_batch adds into the last training step's scalar otherwise
                    out = engine.eval_batch(iter([micro_batch(latents, cond, noise, timesteps, pooled, references)]),
                                            compute_loss=True, reduce_output=None, bcast_loss=False,
                                            num_micro_batches=1)
                    losses = out[0].detach().double().to(engine.device) if engine.is_last_stage() else \
                        torch.zeros(len(chunk), dtype=torch.float64, device=engine.device)
                    torch.distributed.broadcast(losses, src=last, group=engine.grid.get_pipe_parallel_group())
                    for item, value in zip(chunk, losses.cpu()):
                        per_item[qn, position[item]] = value
    finally:
        loss.evaluating = False
        engine.total_loss = None
        engine.module.train()
    return summarise(per_item, quantiles, len(indices))
