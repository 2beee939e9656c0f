"""The parallel layout, chosen once from the spec, behind one small interface: train a step, evaluate, gather the
weights for export, save and load.

- WholeModel: every process holds the whole model (one process, data parallel, ZeRO 0-3); the loop runs the
  micro-batches through DeepSpeed's engine itself.
- PipelineStages: the model's layers split across processes (DeepSpeed's PipelineModule, data parallel across
  pipelines); the engine runs the micro-batches through the stages.

Both run on a DeepSpeed engine at any world size, so a step's arithmetic is the same whoever drives it.
"""
from __future__ import annotations

import contextlib

import torch

from ..run import checkpoint as ckpt
from .distributed import init_distributed, rank, uses_deepspeed, world_size
from .plain_engine import GradientClipping


class ParallelLayout:
    """What the loop asks of a layout. `module` is what DeepSpeed wraps, `trainable` its trainable parameters
    on this process; `initialize` makes the engine, after which the rest may be called."""
    module: torch.nn.Module
    trainable: list

    def __init__(self, spec):
        self.spec = spec
        self.engine = None
        self.loss_split: dict = {}  # the last train_step's main_loss and prior_loss (runs with prior images)

    def check_data(self, dataset) -> None:
        """Raises, naming the spec field, where this layout cannot train what the dataset holds."""

    def initialize(self, deepspeed, optimizer, scheduler, config: dict):
        from .memory import host_weights_set_aside
        self.deepspeed = deepspeed
        with host_weights_set_aside(self.module):  # block swap's weights stay in host memory (memory.py)
            self.engine, _, _, _ = deepspeed.initialize(model=self.module, optimizer=optimizer,
                                                        lr_scheduler=scheduler, config=config)
        names = getattr(self.engine, "param_names", None)  # DeepSpeed's map, built while they were set aside
        if isinstance(names, dict):
            names.update({p: n for n, p in self.module.named_parameters()})
        return self.engine

    @property
    def device(self):
        return self.engine.device

    @property
    def data_rank(self) -> int:
        """This process's place among the model replicas (which slots of the global batch it trains)."""
        raise NotImplementedError

    def train_step(self, micro_batches) -> tuple[float, float | None]:
        """One optimizer step over this process's micro-batches; (the global mean loss, the gradient norm),
        the same on every process. One host synchronisation for the loss, whatever the accumulation."""
        raise NotImplementedError

    def evaluate(self, dataset, indices, quantiles, seed: int, batch_size: int) -> dict:
        raise NotImplementedError

    def gathered(self, params):
        """A context in which these parameters are whole tensors on every process (for export). Collective."""
        raise NotImplementedError

    def save(self, run_dir, step: int, state: dict, is_rank0: bool, keep_last: int, components=None):
        return ckpt.save_checkpoint(self.engine, run_dir, step, state, is_rank0, keep_last=keep_last,
                                    components=components)

    def load(self, path, components=None) -> dict:
        return ckpt.load_checkpoint(self.engine, path, components)


class WholeModel(ParallelLayout):
    clips_itself = True  # see initialize; the distiller's networks, whose loop drives the engines, leave it
    _clipping: GradientClipping | None = None

    def __init__(self, spec, family, params):
        from ..training_module import TrainingModule
        super().__init__(spec)
        self.module = TrainingModule(family)
        self.trainable = params
        self._own_grad_norm = True  # until the engine shows it reports one (ZeRO, bf16 optimizers do)

    def initialize(self, deepspeed, optimizer, scheduler, config: dict):
        """On DeepSpeed's plain path (fp32, no ZeRO) the engine clips in a pass of its own over every parameter
        of the module, beside the pass the loop makes for the gradient norm it reports: this layout clips
        instead, from that one pass and in the engine's arithmetic (bit for bit the same weights). In one
        process the engine's all-reduce of the gradients only copies them into a buffer and back: left out."""
        low_precision = config["bf16"]["enabled"] or config["fp16"]["enabled"]
        plain = not low_precision and config["zero_optimization"]["stage"] == 0
        if low_precision:  # the engine's optimizer wrapper reports the norm of the gradients it unscaled
            self._own_grad_norm = False
        if self.clips_itself and plain and config["gradient_clipping"] > 0:
            self._clipping = GradientClipping(config["gradient_clipping"])
            config = {**config, "gradient_clipping": 0.0}
        engine = super().initialize(deepspeed, optimizer, scheduler, config)
        if self._clipping is not None:
            self._clipping.order(self.module, self.trainable)
            if world_size() == 1:
                engine.enable_backward_allreduce = False
        return engine

    @property
    def data_rank(self) -> int:
        return rank()

    def train_step(self, micro_batches):
        from ..data.batch_mix import MicroBatch, split_losses
        engine, device = self.engine, self.device
        losses, parts, own_norm = [], [], None
        for inputs in micro_batches:
            args, features = MicroBatch(*(x.to(device) if x is not None else None for x in inputs)).model_inputs()
            loss = engine(*args, **features)
            if "is_prior" in features:  # (loss, its training and prior parts)
                loss, part = loss
                parts.append(part)
            engine.backward(loss)
            if self._clipping is not None and engine.is_gradient_accumulation_boundary():
                own_norm = self._clipping.clip()
            elif self._own_grad_norm and engine.is_gradient_accumulation_boundary():
                own_norm = grad_norm(self.trainable)
            engine.step()
            losses.append(loss.detach())
        values = torch.stack(losses).double()
        if parts:  # read back with the losses: still one wait
            values = torch.cat([values, torch.stack(parts).sum(0).double()])
        values = values.cpu().tolist()  # the step's one wait for the device
        values, part_sums = values[:len(losses)], values[len(losses):]
        mean = global_mean(sum(values) / len(values), device)
        self.loss_split = split_losses(global_sum(part_sums, device)) if parts else {}
        reported = engine.get_global_grad_norm()
        if reported:
            self._own_grad_norm = False
            return mean, reported
        return mean, own_norm.item() if own_norm is not None else None

    def evaluate(self, dataset, indices, quantiles, seed, batch_size):
        from ..tasks.evaluation import evaluate
        return evaluate(self.module, dataset, indices, quantiles, seed, batch_size, self.device)

    def gathered(self, params):
        if self.spec.distributed.zero_stage == 3:  # each process holds a slice of every parameter
            return self.deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        return contextlib.nullcontext()


class PipelineStages(ParallelLayout):
    def __init__(self, spec, family):
        from . import pipeline
        super().__init__(spec)
        self.module, self.loss, self.layers = pipeline.build(family, spec.distributed.pipeline_stages)
        self.trainable = [p for p in self.module.parameters() if p.requires_grad]  # this stage's share
        self._collected = False

    @property
    def data_rank(self) -> int:
        return self.engine.grid.get_data_parallel_rank()

    def initialize(self, deepspeed, optimizer, scheduler, config: dict):
        from .pipeline import receive_buffers_by_dtype
        engine = super().initialize(deepspeed, optimizer, scheduler, config)
        receive_buffers_by_dtype(engine)
        return engine

    def check_data(self, dataset):
        from .pipeline import check_data
        check_data(self.spec.data, dataset, self.layers)

    def train_step(self, micro_batches):
        from .pipeline import micro_batch
        # masks and prior images are refused for pipelines (check_data, RunSpec.validate): the tuple's head and the
        # reference images only
        loss = self.engine.train_batch(iter([micro_batch(*inputs[:5], references=inputs.references)
                                             for inputs in micro_batches]))  # global already
        return loss.item(), self.engine.get_global_grad_norm()

    def evaluate(self, dataset, indices, quantiles, seed, batch_size):
        from .pipeline import evaluate
        return evaluate(self.engine, self.loss, dataset, indices, quantiles, seed, batch_size)

    def gathered(self, params):
        if not self._collected:  # each stage trained its own layers: every process gets all of them, once
            from .pipeline import collect_parameters
            collect_parameters(self.engine, self.layers, trainable_only=self.spec.adapter.kind != "full")
            self._collected = True
        return contextlib.nullcontext()


def choose_engine(spec):
    """What makes the run's engines, with deepspeed.initialize's signature, chosen once (distributed.uses_deepspeed):
    DeepSpeed with its process group set up, or plain PyTorch in one process (plain_engine)."""
    if uses_deepspeed(spec):
        return init_distributed()
    from . import plain_engine
    return plain_engine


def choose_layout(spec, family, params) -> ParallelLayout:
    if spec.distributed.pipeline_stages > 1:
        return PipelineStages(spec, family)
    return WholeModel(spec, family, params)


def grad_norm(params) -> torch.Tensor | None:
    """The 2-norm of the gradients, on the device (no wait for it)."""
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return torch.stack(grads).norm() if grads else None


def global_sum(values: list[float], device) -> torch.Tensor:
    """The sums of these numbers over every process (float64, on the CPU)."""
    t = torch.tensor(values, dtype=torch.float64)
    if world_size() > 1:
        t = t.to(device)
        torch.distributed.all_reduce(t)
    return t.cpu()


def global_mean(value: float, device) -> float:
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.item() / world_size()
