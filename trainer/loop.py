"""The training run: components from the spec, the DeepSpeed engine, the step loop, checkpoints, export."""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import export
from .adapters import (PACK_METADATA_KEY, comfy_adapter_state_dict, inject_adapter, kohya_metadata,
                       load_adapter_weights, save_adapter_atomic, written_by_pack)
from .comfy_env import import_comfy
from .config import RunSpec
from .data import Prefetcher, StepSampler, load_cached_dataset
from .distributed import data_parallel_size, deepspeed_config, init_distributed, rank, world_size
from .evaluation import evaluate
from .events import EVENTS_FILE, EventWriter, read_events
from .layout import STOP_FILE
from .metrics import HealthLog
from .models import Batch, ModelFamily, load_family
from .objectives import training_timesteps
from .sampling import PreviewSampler, sample_due

log = logging.getLogger("ingraph_trainer.trainer")


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being a finite number; the run ends without saving the bad weights."""


def check_finite(step: int, loss: float | None, grad_norm: float | None):
    for what, value in (("loss", loss), ("gradient norm", grad_norm)):
        if value is not None and not math.isfinite(value):
            raise TrainingDiverged(f"{what} became {'NaN' if math.isnan(value) else 'inf'} at step {step}; "
                                   "the last complete checkpoint is intact (lower the learning rate, or resume)")


class TrainingModule(torch.nn.Module):
    """What DeepSpeed wraps: the diffusion model (with its adapter); forward returns the loss."""

    def __init__(self, family: ModelFamily):
        super().__init__()
        self.diffusion_model = family.diffusion_model
        self.family = family

    def forward(self, latents, cond, noise, timesteps, pooled=None):
        return self.family.loss(Batch(latents, cond, pooled, noise, timesteps))


def enable_gradient_checkpointing(blocks):
    for block in blocks:
        forward = block.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)
        block.forward = checkpointed


def enable_block_swap(blocks, device):
    """diffusion-pipe's block swap for adapter training: these blocks' frozen weights live in CPU memory and
    visit the device only while the block runs, in the forward pass and again when the backward pass
    recomputes it (swapped blocks are checkpointed, so no copy outlives its block's use). Trainable adapter
    weights stay on the device, where the optimizer holds them."""
    import threading
    state = threading.local()
    pinned = torch.cuda.is_available()
    for block in blocks:
        frozen = {name: p for name, p in block.named_parameters() if not p.requires_grad}
        host = {name: (p.detach().cpu().pin_memory() if pinned else p.detach().cpu()) for name, p in frozen.items()}
        for name, p in frozen.items():
            p.data = host[name]  # the device copy is freed
        forward = block.forward

        def run_on_device(*args, _block=block, _host=host, **kwargs):
            state.inside = True
            try:
                weights = {name: t.to(device, non_blocking=True) for name, t in _host.items()}
                return torch.func.functional_call(_block, weights, args, kwargs, strict=False)
            finally:
                state.inside = False

        def swapped(*args, _forward=forward, _run=run_on_device, **kwargs):
            if getattr(state, "inside", False):  # functional_call calls the block: run its real forward
                return _forward(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(_run, *args, use_reentrant=False, **kwargs)
        block.forward = swapped


def lr_lambda(spec: RunSpec):
    t = spec.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if t.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def build_optimizer(spec: RunSpec, params):
    t = spec.train
    if t.optimizer == "adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)


def gathered(deepspeed, params, zero_stage: int):
    """Under ZeRO-3 each rank holds a slice of every parameter; gather them to read whole tensors."""
    import contextlib
    if zero_stage == 3:
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def _grad_norm(params) -> float | None:
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return torch.stack(grads).norm().item() if grads else None


class Trainer:
    def __init__(self, spec: RunSpec, events: EventWriter):
        self.spec = spec
        self.events = events
        self.run_dir = Path(spec.run_dir)
        self.is_rank0 = rank() == 0

    def _global_mean(self, value: float) -> float:
        if world_size() == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return t.item() / world_size()

    def _stop_requested(self) -> bool:
        """Rank 0 reads the STOP mark and every rank follows its answer, so all save the same step and
        no rank waits in a collective that another has left."""
        wanted = self.is_rank0 and (self.run_dir / STOP_FILE).exists()
        if world_size() == 1:
            return wanted
        flag = torch.tensor([1 if wanted else 0], dtype=torch.int32, device=self.device)
        torch.distributed.broadcast(flag, src=0)
        return bool(flag.item())

    def _drop_stale_stop(self, started_at: float):
        """A STOP left from before this process started (a stop that came as the last run ended, a run resumed
        by hand) is not a request to this run; one written during start-up is."""
        stop = self.run_dir / STOP_FILE
        try:
            import psutil  # a ComfyUI requirement: when this process began, imports included
            started_at = psutil.Process().create_time()
        except Exception:  # noqa: BLE001 - the run's own start is the next best answer
            pass
        try:
            if self.is_rank0 and stop.stat().st_mtime < started_at:
                stop.unlink()
        except FileNotFoundError:
            pass

    def _consume_stop(self):
        """A stop request is honoured once: a resumed run trains on until it is asked again."""
        if self.is_rank0:
            (self.run_dir / STOP_FILE).unlink(missing_ok=True)

    def _export(self, deepspeed, family, params, num_images: int, steps_done: int, started_at: float) -> str | None:
        """Writes the adapter (or, for a full fine-tune, the diffusion model); rank 0 only, every rank joins."""
        spec, a, zero = self.spec, self.spec.adapter, self.spec.distributed.zero_stage
        if a.kind == "full":
            tensors = {}
            for name, param in family.diffusion_model.named_parameters():  # one at a time: never the whole
                with gathered(deepspeed, [param], zero):                  # model twice in memory
                    if self.is_rank0:
                        tensors[name] = param.detach().to("cpu").clone()
            for name, buffer in family.diffusion_model.named_buffers():
                tensors[name] = buffer.detach().to("cpu").clone()
            meta = {PACK_METADATA_KEY: json.dumps({"spec_version": spec.version, "family": family.name,
                                                   "prediction": family.prediction, "kind": "full",
                                                   "steps": steps_done})}
        else:
            # DoRA's export reads the base weights too; under ZeRO-3 they are sharded like the rest
            export_params = list(family.diffusion_model.parameters()) if a.kind == "dora" else params
            with gathered(deepspeed, export_params, zero):  # collective: every rank enters
                tensors = comfy_adapter_state_dict(family.diffusion_model, a.kind, a.alpha)
            tensors = export.convert(tensors, spec.output.format, export.diffusers_module_names(family.base_model)
                                     if spec.output.format != "comfyui" else {})
            meta = kohya_metadata(spec, family, num_images, steps_done, started_at)
        if not self.is_rank0:
            return None
        target = Path(spec.output.lora_path)
        if target.exists() and not spec.output.overwrite and not written_by_pack(target):
            # a file of the user's appeared there during the run: never replaced silently, and the result is kept
            kept = save_adapter_atomic(self.run_dir / target.name, tensors, meta)
            raise FileExistsError(f"{target} exists and was not written by InGraph Trainer, so it was left alone; "
                                  f"this run's result is in {kept} (turn on overwrite to replace such a file)")
        return str(save_adapter_atomic(target, tensors, meta))

    def run(self):
        spec, t = self.spec, self.spec.train
        started_at = time.time()
        import_comfy()  # the launching server's ComfyUI, never the spec's
        family = load_family(spec.model.path, spec.model.family, spec.model.prediction)
        family.set_objective(t.loss, t.huber_delta, t.min_snr_gamma, t.flow_shift, t.guidance)
        family.check_settings(spec)
        dataset = load_cached_dataset(spec.data.manifest)
        eval_dataset = load_cached_dataset(spec.data.eval_manifest) if spec.data.eval_manifest else dataset
        eval_indices = eval_dataset.unique

        torch.manual_seed(t.seed)  # adapter initialisation
        a = spec.adapter
        if a.kind == "full":
            targets = []
            params = list(family.diffusion_model.requires_grad_(True).parameters())
        else:
            targets = family.adapter_targets(a.targets)
            params = inject_adapter(family.diffusion_model, targets, a.kind, a.rank, a.alpha, a.dropout)
            if a.init_from:
                load_adapter_weights(family.diffusion_model, a.kind, a.init_from,
                                     export.diffusers_module_names(family.base_model))
        d = spec.distributed
        deepspeed = init_distributed()  # before the model: pipeline stages need the process group
        blocks = family.checkpoint_blocks() if (t.gradient_checkpointing or d.block_swap) else []
        if d.block_swap > len(blocks):
            raise ValueError(f"distributed.block_swap: this model has {len(blocks)} blocks (got {d.block_swap})")
        if t.gradient_checkpointing:  # swapped blocks are checkpointed by the swap itself
            enable_gradient_checkpointing(blocks[d.block_swap:])
        pipe_loss = pipe_layers = None
        if d.pipeline_stages > 1:
            from . import pipeline
            module, pipe_loss, pipe_layers = pipeline.build(family, d.pipeline_stages)
            stage_params = [p for p in module.parameters() if p.requires_grad]  # this stage's share
        else:
            module = TrainingModule(family)
            stage_params = params
        optimizer = build_optimizer(spec, stage_params)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))

        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=deepspeed_config(spec))
        self.device = engine.device
        if d.block_swap:
            enable_block_swap(blocks[:d.block_swap], self.device)
        world = data_parallel_size(spec)
        data_rank = engine.grid.get_data_parallel_rank() if pipe_loss is not None else rank()
        global_batch = t.batch_size * t.grad_accum * world
        sampler = StepSampler(dataset.buckets, global_batch, t.seed, spec.data.shuffle)

        self._drop_stale_stop(started_at)
        start_step = 0
        resume_from = ckpt.resolve_resume(self.run_dir, t.resume)
        if resume_from is not None:
            state = ckpt.load_checkpoint(engine, resume_from)
            start_step = int(state["step"])

        self.events.emit("started", run_dir=str(self.run_dir), total=t.steps, start_step=start_step,
                         world_size=world_size(), data_parallel=world, pipeline_stages=d.pipeline_stages,
                         block_swap=d.block_swap, family=family.name, prediction=family.prediction,
                         objective={"loss": t.loss, "min_snr_gamma": t.min_snr_gamma},
                         adapted_modules=len(targets), trainable_params=sum(p.numel() for p in params),
                         dataset_items=len(dataset.unique), samples=len(dataset), eval_items=len(eval_indices),
                         resumed_from=str(resume_from) if resume_from else None)

        health = HealthLog(self.run_dir, self.is_rank0)
        best: dict = {}
        if start_step:  # the best evaluation before the interruption still counts
            for event in read_events(self.run_dir / EVENTS_FILE):
                step_, loss_ = event.get("step"), event.get("loss")  # the file is under output/: anything goes
                if event["type"] == "eval" and isinstance(step_, int) and isinstance(loss_, (int, float)) \
                        and step_ <= start_step and loss_ < best.get("loss", math.inf):
                    best.update(step=step_, loss=loss_)
        previews = PreviewSampler(spec.samples, family, self.run_dir, self.is_rank0) if spec.samples.every else None

        def run_eval(step: int):
            if pipe_loss is not None:
                from .pipeline import evaluate as evaluate_stages
                result = evaluate_stages(engine, pipe_loss, eval_dataset, eval_indices, t.eval_quantiles, t.seed,
                                         t.batch_size)
            else:
                result = evaluate(module, eval_dataset, eval_indices, t.eval_quantiles, t.seed, t.batch_size,
                                  self.device)
            if not best or result["loss"] < best["loss"]:
                best.update(step=step, loss=result["loss"])
            self.events.emit("eval", step=step, best_step=best["step"], **result)
            health.eval(step, result)
            return result

        eval_before = run_eval(start_step) if start_step == 0 else None
        step_times: list[float] = []
        data_wait = 0.0
        final_loss = None
        stopped = False
        step = start_step

        def load_step(step: int):
            """This rank's micro-batches of the step: (latents, cond, noise, timesteps, pooled) each."""
            indices = sampler.indices(step)
            starts = [(m * world + data_rank) * t.batch_size for m in range(t.grad_accum)]
            batches = [dataset.batch(indices[lo:lo + t.batch_size]) for lo in starts]
            noise, uniform = sampler.noise_and_timesteps(step, tuple(batches[0][0].shape[1:]))
            timesteps = training_timesteps(uniform, t.timestep_sampling, t.logit_mean, t.logit_std)
            micro = [(latents, cond, noise[lo:lo + t.batch_size], timesteps[lo:lo + t.batch_size], pooled)
                     for (latents, cond, pooled), lo in zip(batches, starts)]
            return indices, micro, timesteps

        prefetch = Prefetcher(load_step)
        for step in range(start_step, t.steps):
            t0 = time.perf_counter()
            indices, micro_batches, timesteps = prefetch.get(step, step + 1 if step + 1 < t.steps else None)
            data_wait += time.perf_counter() - t0
            step_buckets = sorted({dataset.buckets[i] for i in indices})
            lr = optimizer.param_groups[0]["lr"]
            losses, grad_norm = [], None
            latent_std = [inputs[0].float().std().item() for inputs in micro_batches]
            if pipe_loss is not None:  # the engine runs the micro-batches through the stages; loss is global
                from .pipeline import micro_batch
                final_loss = engine.train_batch(iter([micro_batch(*inputs) for inputs in micro_batches])).item()
            else:
                for inputs in micro_batches:
                    latents, cond, noise, micro_t, pooled = (x.to(self.device) if x is not None else None
                                                             for x in inputs)
                    loss = engine(latents, cond, noise, micro_t, pooled)
                    engine.backward(loss)
                    if engine.is_gradient_accumulation_boundary():
                        grad_norm = _grad_norm(params)
                    engine.step()
                    losses.append(loss.item())
                final_loss = self._global_mean(sum(losses) / len(losses))
            grad_norm = engine.get_global_grad_norm() or grad_norm
            step_time = time.perf_counter() - t0
            step_times.append(step_time)
            recent = step_times[-20:]
            avg = sum(recent) / len(recent)
            done = step + 1
            grad_norm = float(grad_norm) if grad_norm is not None else None
            check_finite(done, final_loss, grad_norm)  # every rank sees the same global values: all stop together
            samples_per_s = global_batch / step_time
            t_mean = timesteps.mean().item()
            t_std = timesteps.std().item() if len(timesteps) > 1 else 0.0
            self.events.emit("step", step=done, total=t.steps, loss=final_loss, lr=lr, grad_norm=grad_norm,
                             samples_per_s=samples_per_s, step_time_s=step_time,
                             eta_s=avg * (t.steps - done), data_wait_s=round(data_wait, 4),
                             buckets=[list(b) for b in step_buckets], timestep_mean=t_mean, timestep_std=t_std)
            health.step(done, **{"train/loss": final_loss, "train/lr": lr, "train/grad_norm": grad_norm,
                                 "train/param_norm": torch.stack([p.detach().float().norm() for p in params]).norm().item(),
                                 "perf/step_time_s": step_time, "perf/samples_per_s": samples_per_s,
                                 "perf/data_wait_s": data_wait, "data/timestep_mean": t_mean,
                                 "data/timestep_std": t_std, "data/latent_std": sum(latent_std) / len(latent_std)})
            if t.eval_every and done % t.eval_every == 0 and done < t.steps:
                run_eval(done)
            if previews is not None and sample_due(spec.samples, done, t.steps):
                self.events.emit("sample", step=done, images=previews.render(module, done), prompts=spec.samples.prompts)
            stop_requested = self._stop_requested()
            if done < t.steps and ((t.save_every and done % t.save_every == 0) or stop_requested):
                path = ckpt.save_checkpoint(engine, self.run_dir, done, {"step": done, "seed": t.seed}, self.is_rank0,
                                            keep_last=t.keep_last)
                self.events.emit("checkpoint", step=done, path=str(path))
            if stop_requested:
                self._consume_stop()
                if done < t.steps:
                    stopped = True
                    break
        else:
            step = t.steps - 1
        prefetch.close()
        steps_done = step + 1

        eval_after = run_eval(steps_done)
        health.close()
        if pipe_layers is not None:  # each stage trained its own layers: bring them together for the file
            from .pipeline import collect_parameters
            collect_parameters(engine, pipe_layers, trainable_only=spec.adapter.kind != "full")
        adapter_path = self._export(deepspeed, family, params, len(dataset.unique), steps_done, started_at)
        steady = step_times[1:] or step_times
        self.events.emit("finished", adapter=adapter_path, steps=steps_done, stopped=stopped, final_loss=final_loss,
                         eval_before=eval_before["loss"] if eval_before else None, eval_after=eval_after["loss"],
                         best_eval_step=best.get("step"), best_eval_loss=best.get("loss"),
                         mean_step_s=sum(steady) / len(steady) if steady else None,
                         data_wait_s=round(data_wait, 4), wall_s=time.time() - started_at)
        return adapter_path
