"""One process in plain PyTorch: the engine of the runs most users make (one GPU, no ZeRO, no pipeline).

It does what DeepSpeed's engine does for such a run, in the same arithmetic, so that a run's numbers do not depend
on whether DeepSpeed is installed (the fixed 5-step fp32 run's losses and adapter are bit-identical to DeepSpeed's
engine, tests/trainer/test_plain_engine.py), and nothing imports DeepSpeed:
- the loss of each micro-batch is divided by the accumulation steps before backward;
- at the accumulation boundary a trained parameter left without a gradient gets zeros (DeepSpeed's all-reduce
  does so), the gradients are clipped by DeepSpeed's rule (GradientClipping), the optimizer steps, every
  gradient is dropped and the scheduler steps;
- bf16 and fp16 (train.precision): every floating parameter is held in that precision and the optimizer steps fp32
  master copies of the trained ones (DeepSpeed's optimizer wrapper without ZeRO); a step whose gradient norm is not
  finite is skipped; fp16 scales the loss dynamically (LossScale).

The object answers the parts of DeepSpeed's engine interface the layouts and the distiller use (`initialize`,
calling it, backward, step, is_gradient_accumulation_boundary, get_global_grad_norm, device, module,
save_checkpoint, load_checkpoint), so a layout runs on either without knowing which.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .distributed import world_size

STATE_FILE = "plain_engine.pt"
DEEPSPEED_STATE_FILE = "mp_rank_00_model_states.pt"  # what DeepSpeed's engine writes (an earlier version's runs)
LOW_PRECISION_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fp8 stays fp8


def initialize(model=None, optimizer=None, lr_scheduler=None, config: dict | None = None, **_):
    """deepspeed.initialize's shape: (engine, optimizer, data loader, scheduler)."""
    engine = PlainEngine(model, optimizer, lr_scheduler, config or {})
    return engine, optimizer, None, lr_scheduler


def move_to_device(module: torch.nn.Module, device) -> None:
    """module.to(device), but for the weights block swap keeps in host memory (memory.enable_block_swap marks them
    host_resident): a model larger than the card trains, its swapped blocks never having been on it whole. Each
    other layer moves through its own _apply (ComfyUI's quantized layers re-wrap their weights there)."""
    def host(sub):
        return any(getattr(p, "host_resident", False) for p in sub._parameters.values() if p is not None)
    if not any(host(sub) for sub in module.modules()):
        module.to(device)
        return
    for sub in module.modules():
        if not host(sub):
            sub._apply(lambda t: t.to(device), recurse=False)
            continue
        for name, p in sub._parameters.items():
            if p is not None and not getattr(p, "host_resident", False) and p.device != device:
                p.data = p.data.to(device)
        for name, b in sub._buffers.items():
            if b is not None and b.device != device:
                sub._buffers[name] = b.to(device)


def hold_in(module: torch.nn.Module, dtype, device) -> None:
    """The engine's placement of a model: its floating parameters in `dtype` (None: as they are; fp8 and the
    weights block swap keeps in host memory stay as they are, buffers too), then on `device` (move_to_device).
    The evaluate task places its model so as well: an fp8 base stays fp8 there, and its numbers are training's."""
    if dtype is not None:
        for p in module.parameters():
            if p.dtype in LOW_PRECISION_CASTABLE and p.dtype != dtype and not getattr(p, "host_resident", False):
                p.data = p.data.to(dtype)
    move_to_device(module, device)


class PlainEngine:
    def __init__(self, module: torch.nn.Module, optimizer, scheduler, config: dict):
        from ..device import training_device
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, scheduler
        self.grad_accum = int(config.get("gradient_accumulation_steps", 1))
        self.max_norm = float(config.get("gradient_clipping", 0.0))
        fp16 = config.get("fp16", {})
        self.low_precision = torch.bfloat16 if config.get("bf16", {}).get("enabled") else \
            torch.float16 if fp16.get("enabled") else None
        self.device = training_device()
        self.micro_steps = self.global_steps = 0
        self.enable_backward_allreduce = True  # as DeepSpeed's: off, a layout that fills gradients itself
        self._global_grad_norm = None
        self._params = list(module.parameters())
        hold_in(module, self.low_precision, self.device)
        self.masters = MasterWeights(optimizer) if self.low_precision is not None and optimizer is not None else None
        self.scaler = LossScale(2.0 ** fp16.get("initial_scale_power", 16), fp16.get("loss_scale_window", 1000)) \
            if self.low_precision == torch.float16 else None
        self._clipping = None
        if self.max_norm > 0 and optimizer is not None and self.masters is None:
            self._clipping = GradientClipping(self.max_norm)
            self._clipping.order(module, [])

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def backward(self, loss):
        scaled = loss / self.grad_accum
        (scaled * self.scaler.scale if self.scaler is not None else scaled).backward()
        if self.is_gradient_accumulation_boundary() and self.enable_backward_allreduce:
            for p in self._params:
                if p.requires_grad and p.numel() and p.grad is None:
                    p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)
        return scaled

    def step(self):
        if self.is_gradient_accumulation_boundary():
            applied = True
            if self.masters is not None:
                scale = self.scaler.scale if self.scaler is not None else 1.0
                self._global_grad_norm, applied = self.masters.step(self.max_norm, scale)
                if self.scaler is not None:
                    self.scaler.update(applied)
                    if not applied:  # an overflow of the scaled gradients, not of the training: no norm to report
                        self._global_grad_norm = None
            else:
                if self._clipping is not None:
                    self._clipping.clip()
                self.optimizer.step()
            for p in self._params:
                p.grad = None
            if applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
        self.micro_steps += 1

    def get_global_grad_norm(self):
        return self._global_grad_norm

    def trained_state(self) -> dict:
        """The trained parameters by name (what DeepSpeed saves with exclude_frozen_parameters)."""
        return {name: p.detach() for name, p in self.module.named_parameters() if p.requires_grad}

    def save_checkpoint(self, save_dir, tag, client_state=None, **_):
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.trained_state(),
                    "masters": self.masters.state() if self.masters is not None else None,
                    "loss_scale": self.scaler.state_dict() if self.scaler is not None else None,
                    "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                    "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                    "micro_steps": self.micro_steps, "global_steps": self.global_steps,
                    "client_state": client_state or {}}, folder / STATE_FILE)

    def load_checkpoint(self, load_dir, tag, **_):
        """(the folder, the client state); the weights, optimizer, scheduler and step counts restored. The file
        was checked against its signed digest by checkpoint.load_checkpoint and is read without pickle's code."""
        folder = Path(load_dir) / tag
        if not (folder / STATE_FILE).is_file():
            if (folder / DEEPSPEED_STATE_FILE).is_file():
                state = self._from_deepspeed(folder)
            else:
                raise ValueError(f"checkpoint {folder.name} holds no {STATE_FILE}")
        else:
            state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
        trained = dict(self.module.named_parameters())
        missing = [name for name, p in trained.items() if p.requires_grad and name not in state["module"]]
        if missing:
            raise ValueError(f"checkpoint {folder.name} lacks {len(missing)} trained weights (such as {missing[0]}):"
                             " it was saved by a run with other adapter settings")
        with torch.no_grad():
            for name, value in state["module"].items():
                if name in trained:
                    trained[name].copy_(value)
        if self.masters is not None:
            self.masters.load(state["masters"])
        if self.scaler is not None and state.get("loss_scale"):
            self.scaler.load_state_dict(state["loss_scale"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.micro_steps, self.global_steps = state["micro_steps"], state["global_steps"]
        return str(folder), state["client_state"]

    def _from_deepspeed(self, folder: Path) -> dict:
        """A checkpoint DeepSpeed's one-process engine wrote (a run started before one-process runs trained
        without it), in this engine's form: its trained weights, optimizer (bf16: the fp32 masters and the wrapped
        optimizer's state), scheduler, step count and client state. DeepSpeed's file is a pickle with its config
        in it; like DeepSpeed, this reads the private copy whose every byte checkpoint.load_checkpoint checked
        against the signed digests."""
        saved = torch.load(folder / DEEPSPEED_STATE_FILE, map_location="cpu", weights_only=False)
        optimizer, masters = saved.get("optimizer"), None
        if isinstance(optimizer, dict) and "optimizer_state_dict" in optimizer:  # its bf16 / fp16 wrapper
            masters = [t for group in optimizer.get("fp32_groups", []) for t in group]
            optimizer = optimizer["optimizer_state_dict"]
        if optimizer is None or (self.masters is not None) != (masters is not None):
            raise ValueError(f"checkpoint {folder.name} was written by DeepSpeed's engine in another layout or "
                             "precision; resume it with the settings it was trained with")
        own = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
               "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version"}
        steps = int(saved["global_steps"])
        return {"module": saved["module"], "masters": masters, "optimizer": optimizer,
                "lr_scheduler": saved.get("lr_scheduler"), "global_steps": steps,
                "micro_steps": steps * self.grad_accum,
                "client_state": {k: v for k, v in saved.items() if k not in own and not k.startswith("ds_")}}


class GradientClipping:
    """DeepSpeed's clip_grad_norm_ (deepspeed/runtime/utils.py, what the engine runs on its fp32 path without
    ZeRO) in the same arithmetic and parameter order, from per-parameter norms that also give the gradient norm
    the loop reports (grad_norm's, the same bits)."""

    def __init__(self, max_norm: float):
        self.max_norm = max_norm

    def order(self, module: torch.nn.Module, reported: list):
        """The engine's order (the module's parameters), and where each reported parameter sits in it."""
        self.params = [p for p in module.parameters() if p.requires_grad]
        place = {id(p): i for i, p in enumerate(self.params)}
        self.reported = [place[id(p)] for p in reported]

    def clip(self) -> torch.Tensor | None:
        """Clips the gradients in place; the 2-norm of the reported parameters' gradients before clipping.
        A trained parameter the step left without a gradient gets zeros first, as the engine's all-reduce gives
        it (in every process count): the optimizer then still decays and moves it."""
        for p in self.params:
            if p.grad is None and p.numel():
                p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)
        norms = {i: p.grad.detach().float().norm(2.0) for i, p in enumerate(self.params) if p.grad is not None}
        if not norms:
            return None
        reported = [norms[i] for i in self.reported if i in norms]
        total = torch.stack(list(norms.values())).pow(2.0).sum().float().pow(1.0 / 2.0)
        total = total * 1.0 / float(world_size())
        if world_size() > 1:
            torch.distributed.all_reduce(total)
        clip_coef = torch.min(torch.tensor([1.0], device=total.device),
                              torch.tensor([float(self.max_norm)], device=total.device) / (total + 1e-6))
        for i in norms:
            self.params[i].grad.detach().mul_(clip_coef)
        return torch.stack(reported).norm() if reported else None


class LossScale:
    """fp16's dynamic loss scale (DeepSpeed's and torch.amp's rule): the loss is multiplied by it before backward;
    a step whose gradients overflow is skipped and the scale halved (not below 1); after `window` clean steps in a
    row it doubles."""

    def __init__(self, scale: float, window: int):
        self.scale, self.window, self.clean = float(scale), int(window), 0

    def update(self, applied: bool):
        if not applied:
            self.scale, self.clean = max(1.0, self.scale / 2), 0
            return
        self.clean += 1
        if self.clean >= self.window:
            self.scale, self.clean = self.scale * 2, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean": self.clean}

    def load_state_dict(self, state: dict):
        self.scale, self.clean = float(state["scale"]), int(state["clean"])


class MasterWeights:
    """fp32 copies of low-precision trained parameters, which the optimizer steps (DeepSpeed's unfused bf16
    optimizer without ZeRO): the optimizer's param groups are pointed at the copies, the gradients are copied up
    before a step and the weights copied down after it."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.pairs = []  # (model parameter, its fp32 master)
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                master = p.detach().clone().float() if p.dtype != torch.float32 else p
                if master is not p:
                    master.requires_grad_(True)
                self.pairs.append((p, master))
                masters.append(master)
            group["params"] = masters

    def step(self, max_norm: float, loss_scale: float = 1.0) -> tuple[float, bool]:
        """(the gradient norm, whether the step was applied: not where the norm is not finite). The gradients are
        divided by `loss_scale` (fp16's) in fp32, before the norm and the clipping."""
        norms = []
        for p, master in self.pairs:
            grad = p.grad if p.grad is not None else torch.zeros(p.size(), dtype=p.dtype, device=p.device)
            master.grad = grad.to(torch.float32) if master is not p else grad
            if loss_scale != 1.0:
                master.grad = master.grad / loss_scale
            norms.append(master.grad.detach().norm(2.0))
        total = torch.stack(norms).norm(2.0).item() if norms else 0.0
        if not (total == total and total != float("inf")):
            for _, master in self.pairs:
                master.grad = None
            return total, False
        if max_norm > 0:
            scale = (total + 1e-6) / max_norm
            if scale > 1:
                for _, master in self.pairs:
                    master.grad.mul_(1.0 / scale)
        self.optimizer.step()
        with torch.no_grad():
            for p, master in self.pairs:
                master.grad = None
                if master is not p:
                    p.copy_(master)
        return total, True

    def state(self) -> list:
        return [master.detach() for _, master in self.pairs]

    def load(self, saved: list | None):
        if saved is None or len(saved) != len(self.pairs):
            raise ValueError("checkpoint: its fp32 master weights do not match this run's trained weights")
        with torch.no_grad():
            for (p, master), value in zip(self.pairs, saved):
                master.copy_(value)
                if master is not p:
                    p.copy_(master)
