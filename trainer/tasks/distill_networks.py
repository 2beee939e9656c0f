"""The networks of a DMD2 distillation (distill.py): the module each engine wraps (Denoiser: the family's x0 and
training loss, the GAN head's logit), a trained network on WholeModel's layout, and the generator's and fake scores'
engines saved and loaded as one checkpoint; with what the distiller reports of them."""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from ..run.checkpoint import load_checkpoint, save_checkpoint
from ..parallel.distributed import world_size
from ..parallel.layouts import ParallelLayout, WholeModel
from ..models import Batch


@contextlib.contextmanager
def frozen(params: list):
    """Within: these weights take no gradient."""
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


class GanHead(torch.nn.Module):
    """The GAN classifier: two convolutions over a denoised latent ([B, C, (T,) H, W]; frames as images), pooled
    to one logit per sample. It reads the fake score's x0 prediction, so it is family-agnostic."""

    def __init__(self, channels: int, width: int = 64):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(channels, width, 3, padding=1), torch.nn.SiLU(),
            torch.nn.Conv2d(width, width, 4, stride=2, padding=1), torch.nn.SiLU())
        self.logit = torch.nn.Linear(width, 1)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        frames = x0.shape[2] if x0.dim() == 5 else 1
        if x0.dim() == 5:
            x0 = x0.transpose(1, 2).reshape(-1, *x0.shape[1:2], *x0.shape[3:])
        dtype = self.logit.weight.dtype
        h = self.features(x0.to(dtype)).mean(dim=(2, 3))
        return self.logit(h.view(-1, frames, h.shape[-1]).mean(1)).squeeze(-1).float()


class Denoiser(torch.nn.Module):
    """One network of the distillation, what its engine wraps: forward("x0", x, sigma, cond, pooled, references)
    is the denoised latent (fp32) as ComfyUI's sampling computes it; forward("loss", latents, cond, pooled, noise,
    timesteps, references) the family's per-sample training loss; forward("logit", ...) the GAN head's logit on
    the x0 ("x0"'s arguments)."""

    def __init__(self, family, head: GanHead | None = None):
        super().__init__()
        self.diffusion_model = family.diffusion_model
        self.head = head
        self.family = family

    def forward(self, kind: str, *args):
        if kind == "x0":
            return self.x0(*args)
        if kind == "logit":
            return self.head(self.x0(*args))
        latents, cond, pooled, noise, timesteps, references = args
        return self.family.loss(Batch(latents, cond, pooled, noise, timesteps, None, references), reduce=False)

    def x0(self, x, sigma, cond, pooled=None, references=None):
        family = self.family
        sampling, dtype = family.base_model.model_sampling, family.weight_dtype()
        shaped = sigma.view((-1,) + (1,) * (x.dim() - 1))
        x_in = sampling.calculate_input(shaped, x)
        kwargs = family.model_kwargs(Batch(x, cond, pooled, x, sigma, None, references), x, dtype)
        c_concat = kwargs.pop("c_concat", None)
        if c_concat is not None:
            x_in = torch.cat([x_in, c_concat.to(x_in.dtype)], dim=1)
        out = family.run_model(x_in.to(dtype), sampling.timestep(sigma).float(), kwargs)
        return sampling.calculate_denoised(shaped, out.float(), x)


class Network(WholeModel):
    """A trained network of the distillation on WholeModel's layout (a DeepSpeed engine at any world size, ZeRO
    0-3, whole weights gathered for export), with a module of the distillation's own."""
    clips_itself = False  # the distiller's loop drives the engine: it clips, as configured

    def __init__(self, spec, module: torch.nn.Module, params: list):
        ParallelLayout.__init__(self, spec)
        self.module, self.trainable = module, params
        self._own_grad_norm = True


class Engines:
    """The generator's and the fake scores' engines as the one engine checkpoint.py saves and loads: each writes
    its own DeepSpeed files (weights, optimizer, scheduler) into its own folder of the checkpoint; the client
    state (the trainer's step, the random state) travels with the generator's."""

    def __init__(self, engines: dict):
        self.engines = engines  # name → engine; the first one carries the client state

    def save_checkpoint(self, save_dir, tag, client_state, **kwargs):
        for n, (name, engine) in enumerate(self.engines.items()):
            engine.save_checkpoint(str(Path(save_dir) / tag), tag=name, client_state=client_state if n == 0 else {},
                                   **kwargs)

    def load_checkpoint(self, load_dir, tag, **kwargs):
        saved = {p.name for p in (Path(load_dir) / tag).glob("fake*") if p.is_dir()}
        wanted = {name for name in self.engines if name.startswith("fake")}
        if saved and saved != wanted:  # a run resumed with distill.fake_score_per_step changed
            raise ValueError(f"{Path(load_dir) / tag}: it holds {len(saved)} fake score(s) and this run has "
                             f"{len(wanted)}: resume with distill.fake_score_per_step (the Distill node's "
                             "fake_score_per_step) as it was when the checkpoint was saved")
        found = None
        for n, (name, engine) in enumerate(self.engines.items()):
            path, client_state = engine.load_checkpoint(str(Path(load_dir) / tag), tag=name, **kwargs)
            if path is None:
                return None, None
            if n == 0:
                found = (path, client_state)
        return found


class Networks:
    """What Checkpointer asks of a layout (save, load), over every trained network."""

    def __init__(self, generator: Network, fakes: list):
        # the first fake score's folder is "fake" whether or not there are more (distill.fake_score_per_step)
        self.engine = Engines({"generator": generator.engine, "fake": fakes[0].engine,
                               **{f"fake_step{k + 1}": f.engine for k, f in enumerate(fakes) if k}})

    def save(self, run_dir, step, state, is_rank0, keep_last, components=None):
        return save_checkpoint(self.engine, run_dir, step, state, is_rank0, keep_last=keep_last,
                               components=components)

    def load(self, path, components=None) -> dict:
        return load_checkpoint(self.engine, path, components)


def fake_score_spec(spec):
    """The spec the fake score's optimizer and schedule are built from: its own learning rate, and as many
    scheduler steps as it takes (fake_updates per generator update)."""
    t, n = spec.train, spec.distill.fake_updates
    return dataclasses.replace(spec, train=dataclasses.replace(t, learning_rate=spec.distill.fake_learning_rate,
                                                               steps=t.steps * n, warmup_steps=t.warmup_steps * n))


def peak_rss_per_rank() -> list:
    """Each process's peak resident memory in bytes (VmHWM, since the first network's load began; None where
    unknown), gathered on every rank: what ZeRO-3 saves per process."""
    from ..os_support import host_memory
    peak = host_memory()[1]
    if world_size() == 1:
        return [peak]
    gathered: list = [None] * world_size()
    torch.distributed.all_gather_object(gathered, peak)
    return gathered


def held_weight_bytes(*modules) -> int:
    """Bytes of the modules' weights this process holds: under ZeRO-3 its partitions, else whole tensors."""
    held = 0
    for module in modules:
        for p in module.parameters():
            part = getattr(p, "ds_tensor", None)
            held += (part.numel() * part.element_size()) if part is not None else p.numel() * p.element_size()
    return held
