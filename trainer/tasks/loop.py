"""The training run, shaped as torchtitan's trainer: components built once from the spec, the parallel layout
chosen once (trainer/parallel/layouts.py), a short train() loop, checkpointing as a component."""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..adapters import dora_norm_for, inject_adapter, load_adapter_weights
from ..run.checkpoint import Checkpointer
from ..comfy_env import import_comfy
from ..spec import RunSpec
from ..data.batch_mix import StepBatches, build_training_data, prior_report
from ..data.dataset_checks import check_text_extras_batching
from ..data.loading import load_cached_dataset
from ..device import device_memory, training_device
from ..os_support import map_large_allocations
from ..parallel.distributed import data_parallel_size, deepspeed_config, world_size
from ..ema import build_average, exported_weights
from .evaluation import eval_subset
from ..run.events import EVENTS_FILE, read_events
from ..export import diffusers_module_names
from ..parallel.layouts import choose_engine, choose_layout
from ..parallel.memory import check_swapped_weights_agree, enable_block_swap, load_peak, memory_savers
from ..metrics import HealthLog, param_norm, param_norm_due
from ..parallel.memory_plan import plan_memory, refuse_unloadable
from ..parallel.memory_sizes import low_precision_dtype
from ..models import load_family
from ..optim import averaged_weights, build_optimizer, build_scheduler
from ..parallel.partitioned_load import DeferredWeights, each_process_peak, load_partitions, why_not_partitioned
from ..run.result import write_result
from ..run.run_control import RunControl
from .base import TrainingTask, check_finite
from ..sampling import PreviewSampler


def refuse_fp8_full_fine_tune(diffusion_model: torch.nn.Module, source: str):
    """A scaled-fp8 file keeps fp8 weights even when loaded as "default": fp8 cannot hold trained weights."""
    from ..adapters import FP8_DTYPES
    fp8 = [name for name, p in diffusion_model.named_parameters() if p.dtype in FP8_DTYPES]
    if fp8:
        raise ValueError(f"adapter.kind: a full fine-tune trains every base weight, which fp8 cannot hold, and "
                         f"{source} holds {len(fp8)} fp8 weights (such as {fp8[0]}); fine-tune a bf16 or fp32 "
                         "file, or train an adapter on this one")


class Trainer(TrainingTask):
    eval_before: dict | None = None  # the evaluation before the first step (eval_before)
    spec: RunSpec

    @property
    def device(self):
        return self.layout.device

    def build(self):
        """Every component, once, from the spec (the order keeps the random stream of the adapter's start)."""
        spec, t, a, d = self.spec, self.spec.train, self.spec.adapter, self.spec.distributed
        import_comfy()  # the launching server's ComfyUI, never the spec's
        self.load_memory: dict = {}
        # the engine (DeepSpeed's process group, or plain PyTorch) first: pipeline stages need the process group to
        # build, and the model's load is measured on its own
        deepspeed = choose_engine(spec)
        began = time.perf_counter()
        # ZeRO-3: the weights go straight into each process's partitions (partitioned_load.py), once the engine's
        # layout is known; until then the model's parameters stay unfilled
        full = spec.adapter.kind == "full"
        self.deferred = DeferredWeights(spec.model.path, before_whole_load=lambda why: refuse_unloadable(
            spec.model, spec.train.precision, full=full, whole_because=why)) if why_not_partitioned(spec) is None \
            else None
        refuse_unloadable(spec.model, spec.train.precision, full=full, partitioned=self.deferred is not None)
        if self.deferred is not None:  # the whole weights each process receives from rank 0 (zero.Init's broadcast),
            map_large_allocations(1 << 20)  # one at a time, leave its memory once partitioned, not stay on the heap
        with load_peak(self.load_memory):
            self.family = family = load_family(spec.model, precision=spec.train.precision, deferred=self.deferred)
        self.base_weight_bytes = family.base_weight_bytes()  # ZeRO-3 leaves a slice of them here once it starts
        self.build_s = {"model": time.perf_counter() - began}  # where the start-up went (the started event)
        family.set_objective(t.loss, t.huber_delta, t.min_snr_gamma, t.flow_shift, t.guidance)
        family.check_settings(spec)
        self.global_batch = t.batch_size * t.grad_accum * data_parallel_size(spec)
        # the training set (mixed with the prior set where there is one) and what each step draws from it
        self.dataset, self.sampler = build_training_data(spec.data, self.global_batch, t.seed, family,
                                                         d.pipeline_stages)
        self.eval_dataset = load_cached_dataset(spec.data.eval_manifest) if spec.data.eval_manifest else self.dataset
        check_text_extras_batching(self.dataset, t.batch_size, spec.data.caption_dropout)
        if spec.data.eval_manifest and t.evaluates:  # evaluated on the captions as written
            check_text_extras_batching(self.eval_dataset, t.batch_size, where="data.eval_manifest")
        self.eval_items = eval_subset(self.eval_dataset.unique, spec.train.eval_items, spec.train.seed) \
            if spec.train.evaluates else []
        self.build_s["data"] = time.perf_counter() - began - sum(self.build_s.values())
        torch.manual_seed(t.seed)  # adapter initialisation
        if a.kind == "full":
            refuse_fp8_full_fine_tune(family.diffusion_model, spec.model.path)
            self.targets, self.params = [], list(family.diffusion_model.requires_grad_(True).parameters())
        else:
            if a.kind == "dora":  # a ComfyUI whose DoRA convention cannot be told fails now, not after the run
                dora_norm_for(spec.output.format)
            self.targets = family.adapter_targets(a.targets, a.kind)
            self.params = inject_adapter(family.diffusion_model, self.targets, a.kind, a.rank, a.alpha, a.dropout,
                                         d.zero_stage)
            if a.init_from:
                load_adapter_weights(family.diffusion_model, a.kind, a.init_from,
                                     diffusers_module_names(family.base_model))
        self.build_s["adapter"] = time.perf_counter() - began - sum(self.build_s.values())
        # before anything reaches the device: "auto"'s checkpointing and block swap, or the run refused
        self.memory_plan = plan_memory(spec, family, self.dataset, training_device(), data_parallel_size(spec),
                                       self.log)
        swapped_blocks = memory_savers(family, self.memory_plan.checkpointing, self.memory_plan.block_swap)
        self.block_copies = None
        if swapped_blocks:  # before the engine, which leaves them on the host (plain_engine; layouts.initialize)
            self.block_copies = enable_block_swap(swapped_blocks, training_device(), low_precision_dtype(t.precision))
            check_swapped_weights_agree(swapped_blocks)
        self.layout = layout = choose_layout(spec, family, self.params)
        layout.check_data(self.dataset)
        optimizer = build_optimizer(spec, layout.trainable)
        self.optimizer = optimizer
        if self.deferred is not None:
            if self.deferred.sources:  # else the model was filled as usual (loading.why_not_deferred, logged)
                load_partitions(deepspeed, layout.module, self.deferred, deepspeed_config(spec),
                                low_precision_dtype(t.precision))
                self.load_memory.update(partitioned=True, **each_process_peak(self.load_memory))
            map_large_allocations(32 << 20)  # glibc's own upper bound for its moving threshold
        layout.initialize(deepspeed, optimizer, build_scheduler(spec, optimizer), deepspeed_config(spec))
        self.ema = build_average(spec, self.params)  # after initialize: on the device the engine put them on
        self.batches = StepBatches(self.dataset, self.sampler, t, spec.data, data_parallel_size(spec),
                                   layout.data_rank)
        checkpointer = Checkpointer(layout, self.run_dir, t.save_every, t.keep_last, self.is_rank0,
                                    components={"ema": self.ema})
        self.control = RunControl(spec, self.events, layout, optimizer, checkpointer, self.is_rank0)
        self.build_s["engine"] = time.perf_counter() - began - sum(self.build_s.values())

    def step(self, step: int, batch) -> tuple[dict, float | None]:
        loss, grad_norm = self.layout.train_step(batch.micro_batches)
        if self.block_copies is not None:
            self.block_copies.reset()
        if self.ema is not None:
            self.ema.update(step)
        grad_norm = float(grad_norm) if grad_norm is not None else None
        check_finite(step, loss, grad_norm)  # every rank sees the same global values: all stop together
        return {"loss": loss}, grad_norm

    def finish(self, step: int, stopped: bool, losses: dict):
        t = self.spec.train
        # after a Stop the user wants the run to end: its evaluation only when asked for (eval_after_stop)
        eval_after = self.evaluate(step) if t.evaluates and (not stopped or t.eval_after_stop) else None
        self.health.close()
        with averaged_weights(self.optimizer), exported_weights(self.spec, self.ema):
            adapter, replaced_kept = write_result(self.spec, self.family, self.params, self.layout, self.is_rank0,
                                                  len(self.dataset.unique), step, self.started_at,
                                                  self.memory_plan.checkpointing)
        eval_before = self.eval_before
        self.events.emit("finished", adapter=adapter, replaced_kept=replaced_kept, steps=step, stopped=stopped,
                         final_loss=losses.get("loss"), eval_before=eval_before["loss"] if eval_before else None,
                         eval_after=eval_after["loss"] if eval_after else None,
                         best_eval_step=self.best.get("step"), best_eval_loss=self.best.get("loss"),
                         mean_step_s=self.control.mean_step_s(),
                         data_wait_s=round(self.data_wait, 4), wall_s=time.time() - self.started_at,
                         device_memory=device_memory(self.layout.device), host_memory=self.host_memory())
        return adapter

    def announce(self, start_step: int, resumed_from):
        """The started event; the health log, the best evaluation so far and the previews of this run."""
        spec, t, d, family = self.spec, self.spec.train, self.spec.distributed, self.family
        prior, prior_warning = prior_report(self.dataset, self.sampler)
        self.events.emit("started", run_dir=str(self.run_dir), total=t.steps, start_step=start_step,
                         world_size=world_size(), data_parallel=data_parallel_size(spec), precision=t.precision,
                         device=str(self.layout.device),
                         pipeline_stages=d.pipeline_stages, block_swap=self.memory_plan.block_swap,
                         gradient_checkpointing=self.memory_plan.checkpointing,
                         memory_plan=self.memory_plan.as_event(), family=family.name,
                         prediction=family.prediction, objective={"loss": t.loss, "min_snr_gamma": t.min_snr_gamma},
                         adapted_modules=len(self.targets), trainable_params=sum(p.numel() for p in self.params),
                         dataset_items=len(self.dataset.unique), samples=len(self.dataset),
                         eval_items=len(self.eval_items), base_weight_bytes=self.base_weight_bytes,
                         load_memory=self.load_memory, build_s={k: round(v, 3) for k, v in self.build_s.items()},
                         resumed_from=str(resumed_from) if resumed_from else None, **prior)
        if prior_warning:
            self.events.emit("log", level="warning", message=prior_warning)
        self.health = HealthLog(self.run_dir, self.is_rank0)
        self.best = best_evaluation(self.run_dir, start_step) if start_step else {}
        self.control.previews = PreviewSampler(spec.samples, family, self.run_dir, self.is_rank0) \
            if spec.samples.every else None
        self.eval_before = self.evaluate(start_step) if start_step == 0 and t.eval_before and t.evaluates else None

    def evaluate(self, step: int) -> dict:
        t = self.spec.train

        def held_out():
            return self.layout.evaluate(self.eval_dataset, self.eval_items, t.eval_quantiles, t.seed, t.batch_size)
        with averaged_weights(self.optimizer):
            result = held_out()
        if self.ema is not None:  # the same items and noise, on the average of the weights
            with self.ema.swapped_in():
                result["ema_loss"] = held_out()["loss"]
        if not self.best or result["loss"] < self.best["loss"]:
            self.best = {"step": step, "loss": result["loss"]}
        self.events.emit("eval", step=step, best_step=self.best["step"], **result)
        self.health.eval(step, result)
        return result

    def report_step(self, step: int, start_step: int, batch, lr: float, losses: dict, grad_norm, step_time: float):
        t, loss = self.spec.train, losses["loss"]
        eta_s = self.control.timed(step, step_time)
        samples_per_s = self.global_batch / step_time
        norm = {"param_norm": param_norm(self.params)} if param_norm_due(step, start_step + 1, t.steps) else {}
        self.events.emit("step", step=step, total=t.steps, loss=loss, lr=lr, grad_norm=grad_norm,
                         samples_per_s=samples_per_s, step_time_s=step_time,
                         eta_s=eta_s, data_wait_s=round(self.data_wait, 4),
                         buckets=[list(b) for b in batch.buckets], timestep_mean=batch.timestep_mean,
                         timestep_std=batch.timestep_std, **norm, **self.layout.loss_split)
        self.health.step(step, **{"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
                                  "train/param_norm": norm.get("param_norm"), "perf/step_time_s": step_time,
                                  **{f"train/{k}": v for k, v in self.layout.loss_split.items()},
                                  "perf/samples_per_s": samples_per_s, "perf/data_wait_s": self.data_wait,
                                  "data/timestep_mean": batch.timestep_mean, "data/timestep_std": batch.timestep_std,
                                  "data/latent_std": batch.latent_std})
        if t.evaluates and t.eval_every and step % t.eval_every == 0 and step < t.steps:
            self.evaluate(step)


def best_evaluation(run_dir: Path, until_step: int) -> dict:
    """The best evaluation before an interruption still counts (read from the run's events)."""
    best: dict = {}
    for event in read_events(run_dir / EVENTS_FILE):
        step, loss = event.get("step"), event.get("loss")  # the file is under output/: anything goes
        if event["type"] == "eval" and isinstance(step, int) and isinstance(loss, (int, float)) \
                and step <= until_step and loss < best.get("loss", math.inf):
            best = {"step": step, "loss": loss}
    return best
