"""DMD2 few-step distillation (task "distill"), built from the adapter trainer's components (trainer/tasks/loop.py).

Three kinds of network of the spec's model family, each loaded with ComfyUI's own code (load_family, so every family's
training patches are its own, never shared through a copy):

- the teacher: the graph's MODEL, frozen, the "real" score, with classifier-free guidance (distill.guidance_scale)
  against the cached empty caption;
- the generator (student): the same model with the spec's adapter (a LoRA, or "full"), trained with its own
  DeepSpeed engine and optimizer at train.learning_rate;
- the fake score: another copy with the same adapter kind, trained with its own engine and optimizer at
  distill.fake_learning_rate, distill.fake_updates times per generator update, on the family's own training
  loss with the generator's (detached) outputs as the clean latents. With distill.fake_score_per_step, one fake
  score per student step (each its own copy, engine, optimizer and checkpoint folder), each trained on outputs of
  its own step and giving the DMD gradient of the samples that step made: one fake score learns the mix of all
  steps' outputs, so only that mix is matched to the teacher (tools/distill_quality.py measured the drift).

Under ZeRO-3 the teacher is a DeepSpeed engine too (no optimizer), so every network is partitioned across the
processes and no process holds whole models. One process and data parallel run the same code.

Every prediction is an x0 (denoised latent) through ComfyUI's model_sampling (calculate_input, calculate_denoised,
noise_scaling), so epsilon, v-prediction and flow models distil alike. The student's noise levels are the sigmas
ComfyUI's KSampler visits with scheduler "sgm_uniform" at distill.student_steps steps, and between steps the
student is re-noised with fresh noise as ComfyUI's "lcm" sampler does.

**Sampling the student in the stock graph**: KSampler with sampler "lcm", scheduler "sgm_uniform", cfg 1.0 and
steps = distill.student_steps samples it exactly as it was trained (a LoRA: LoraLoaderModelOnly on the teacher,
strength 1). With explicit distill.student_timesteps the noise levels are those t along the model's own schedule
(model_sampling.percent_to_sigma(1 - t)); sample with SamplerCustom, sampler "lcm", cfg 1.0, and those sigmas
followed by 0.

One generator update (DMD2, Yin et al. 2024):
1. a student step k per sample; its input at sigma_k is pure noise (k = 0, scaled as KSampler scales it), the
   student's own steps 0..k-1 run from pure noise without gradients (backward_simulation), or the dataset's
   latents noised to sigma_k;
2. the student's x0; for the first distill.regression_steps updates its loss is the MSE to the dataset's latents;
   after, the DMD loss: x_t = x0 noised at t ~ U[min_t, max_t]; real = teacher's guided x0, fake = fake score's
   x0 (no gradients); grad = (fake - real) / mean|x0 - real| per sample; loss = 0.5 * MSE(x0, x0 - grad) *
   dmd_weight (fp32);
3. with distill.gan_weight > 0 the GAN term: a small classifier head (GanHead) reads the fake score's x0
   prediction of a noised latent; the generator's loss adds gan_weight * softplus(-logit) of its noised output
   (through the fake score, whose weights stay as they are), and the fake score's loss adds gan_weight *
   (softplus(logit(generated)) + softplus(-logit(dataset latents))), trained with the fake score's optimizer.

Randomness: every draw is seeded by (train.seed, a stream, the update, the sub-step; with a fake score per step,
sub-step * steps + the step) over the whole global batch
and each process takes its slots (batch_mix.micro_batch_slots), as StepBatches does for the data, so 1 and N
processes, and a resumed run, compute the same numbers.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ..adapters import inject_adapter
from ..data.batch_mix import StepBatches, build_training_data, micro_batch_slots
from ..run.checkpoint import Checkpointer
from ..comfy_env import import_comfy
from ..data.dataset_checks import distillation_audio_problem, latent_channels, text_inputs_beside_the_embedding
from ..device import training_device
from .distill_networks import (Denoiser, GanHead, Network, Networks, fake_score_spec, frozen, held_weight_bytes,
                               peak_rss_per_rank)
from ..parallel.distributed import data_parallel_size, deepspeed_config, world_size
from .dmd2 import STUDENT_SAMPLER, STUDENT_SCHEDULER, DMD2Objective, starts_at_max_noise, student_sigmas
from ..parallel.layouts import choose_engine, global_sum, grad_norm
from .loop import refuse_fp8_full_fine_tune
from ..parallel.memory import checkpointed_with_fp8_kept, load_peak
from ..parallel.memory_plan import plan_distillation
from ..metrics import HealthLog
from ..models import load_family
from ..optim import averaged_weights, build_optimizer, build_scheduler
from ..run.result import write_result
from ..run.run_control import RunControl
from .base import TrainingTask, check_finite
from ..sampling import PreviewSampler

class Distiller(DMD2Objective, TrainingTask):
    # --- building ------------------------------------------------------------------------------------------
    def load(self, precision: str):
        family = load_family(self.spec.model, precision=precision)
        t = self.spec.train
        family.set_objective(t.loss, t.huber_delta, t.min_snr_gamma, t.flow_shift, t.guidance)
        if getattr(self, "dataset", None) is not None:  # the fake scores and the teacher (the generator: its data)
            family.read_dataset(self.dataset)
        return family

    def trainable(self, family, seed: int) -> list:
        """The network's trainable weights: its adapter of the spec's kind (seeded), or every weight."""
        a = self.spec.adapter
        if a.kind == "full":
            refuse_fp8_full_fine_tune(family.diffusion_model, self.spec.model.path)
            return list(family.diffusion_model.requires_grad_(True).parameters())
        torch.manual_seed(seed)
        return inject_adapter(family.diffusion_model, self.targets, a.kind, a.rank, a.alpha, a.dropout,
                              self.spec.distributed.zero_stage)

    def build(self):
        spec, t, dd = self.spec, self.spec.train, self.spec.distill
        import_comfy()
        deepspeed = choose_engine(spec)
        config = deepspeed_config(spec)
        self.load_memory: dict = {}
        # one network at a time, each initialised (under ZeRO-3: partitioned) before the next is loaded
        with load_peak(self.load_memory):
            self.generator_family = generator = self.load(t.precision)
        generator.check_settings(spec)
        self.global_batch = t.batch_size * t.grad_accum * data_parallel_size(spec)
        self.dataset, self.sampler = build_training_data(spec.data, self.global_batch, t.seed, generator)
        caption_problem = dd.guidance_caption_problem(getattr(self.dataset, "main", self.dataset).empty_text
                                                      is not None, spec.data.manifest)
        if caption_problem:  # the spec's own rules (block_swap, ema_decay, ...) were checked as it was read
            raise ValueError(caption_problem)
        beside_text = text_inputs_beside_the_embedding(generator, self.dataset)
        if beside_text:  # the networks are called with the embedding and pooled vector only
            raise ValueError(f"data.manifest: its captions carry the text encoder's {beside_text}, which "
                             f"{generator.display_name} reads; distilling it with them is not yet supported")
        audio_problem = distillation_audio_problem(self.dataset, "data.manifest")
        if audio_problem:
            raise ValueError(audio_problem)
        if getattr(generator, "variant", None) == "ti2v_5b" and getattr(self.dataset, "reference_slots", 0):
            raise ValueError("data.manifest: distilling Wan 2.2 TI2V with start images is not yet supported; "
                             "distil it on items without a start image")
        self.targets = generator.adapter_targets(spec.adapter.targets) if spec.adapter.kind != "full" else []
        self.params = self.trainable(generator, t.seed)
        # before anything reaches the device and before the other networks load: a run that cannot fit is refused
        self.memory_plan = plan_distillation(spec, generator, self.dataset, training_device(), data_parallel_size(spec),
                                            dd.student_steps if dd.fake_score_per_step else 1, self.log)
        checkpointed_with_fp8_kept(generator, t.gradient_checkpointing)
        self.generator = Network(spec, Denoiser(generator), self.params)
        self.optimizer = build_optimizer(spec, self.params)
        self.generator.initialize(deepspeed, self.optimizer, build_scheduler(spec, self.optimizer), config)
        device = self.device = self.generator.device

        # one fake score, or one per student step (distill.fake_score_per_step), each with its own optimizer
        self.fakes, self.fake_params, fake_optimizers = [], [], []
        for _ in range(dd.student_steps if dd.fake_score_per_step else 1):
            fake = self.load(t.precision)
            fake_params = self.trainable(fake, t.seed + 1)
            checkpointed_with_fp8_kept(fake, t.gradient_checkpointing)
            head = None
            if dd.gan_weight > 0:  # one fake score only (DistillSpec.problems)
                torch.manual_seed(t.seed + 2)
                head = GanHead(latent_channels(fake)).to(fake.weight_dtype())
                fake_params = fake_params + list(head.parameters())
            network = Network(spec, Denoiser(fake, head), fake_params)
            fake_spec = fake_score_spec(spec)
            optimizer = build_optimizer(fake_spec, fake_params)
            network.initialize(deepspeed, optimizer, build_scheduler(fake_spec, optimizer), config)
            self.fakes.append(network)
            self.fake_params += fake_params
            fake_optimizers.append(optimizer)
        self.fake, self.fake_optimizer = self.fakes[0], fake_optimizers[0]
        self.fake_family = self.fake.module.family

        self.teacher_family = teacher = self.load(t.precision)
        teacher.diffusion_model.requires_grad_(False)
        teacher_module = Denoiser(teacher).eval()
        if spec.distributed.zero_stage == 3:  # partitioned like the others: an engine with no optimizer
            self.teacher = deepspeed.initialize(model=teacher_module, config=config)[0]
        else:
            self.teacher = teacher_module.to(device)

        sampling = teacher.base_model.model_sampling
        self.sigmas = student_sigmas(sampling, dd.student_steps, list(dd.student_timesteps))
        self.first_at_max = starts_at_max_noise(sampling, self.sigmas[0])
        empty = getattr(self.dataset, "main", self.dataset)
        self.empty_text = empty.text_entry(*empty.empty_text) if empty.empty_text is not None else None
        # the captions as written: the cache's empty caption serves the teacher's guidance, no sample drops its own
        data = dataclasses.replace(spec.data, caption_dropout=0.0)
        self.data_rank = self.generator.data_rank
        self.batches = StepBatches(self.dataset, self.sampler, t, data, data_parallel_size(spec), self.data_rank)
        self.slots = micro_batch_slots(t.batch_size, t.grad_accum, data_parallel_size(spec), self.data_rank)
        checkpointer = Checkpointer(Networks(self.generator, self.fakes), self.run_dir, t.save_every, t.keep_last,
                                    self.is_rank0)
        self.control = RunControl(spec, self.events, self.generator, self.optimizer, checkpointer, self.is_rank0)

    # --- the run -------------------------------------------------------------------------------------------
    def step(self, step: int, batch) -> tuple[dict, float | None]:
        losses, norm = self.update(step, batch.micro_batches)
        check_finite(step, losses["loss"], norm)
        check_finite(step, losses["fake_loss"], None)
        return losses, norm

    def finish(self, step: int, stopped: bool, losses: dict):
        self.health.close()
        with averaged_weights(self.optimizer):
            adapter, replaced_kept = write_result(self.spec, self.generator_family, self.params, self.generator,
                                                  self.is_rank0, len(self.dataset.unique), step, self.started_at)
        self.events.emit("finished", adapter=adapter, replaced_kept=replaced_kept, steps=step, stopped=stopped,
                         final_loss=losses.get("loss"), eval_before=None, eval_after=None, best_eval_step=None,
                         best_eval_loss=None, mean_step_s=self.control.mean_step_s(),
                         data_wait_s=round(self.data_wait, 4), peak_rss_per_rank=peak_rss_per_rank(),
                         wall_s=time.time() - self.started_at)
        return adapter

    def announce(self, start_step: int, resumed_from):
        spec, t, dd, family = self.spec, self.spec.train, self.spec.distill, self.generator_family
        self.events.emit("started", run_dir=str(self.run_dir), total=t.steps, start_step=start_step, task="distill",
                         world_size=world_size(), data_parallel=data_parallel_size(spec), pipeline_stages=1,
                         block_swap=0, family=family.name, prediction=family.prediction,
                         objective={"loss": t.loss, "min_snr_gamma": t.min_snr_gamma},
                         adapted_modules=len(self.targets), trainable_params=sum(p.numel() for p in self.params),
                         fake_trainable_params=sum(p.numel() for p in self.fake_params),
                         dataset_items=len(self.dataset.unique), samples=len(self.dataset), eval_items=0,
                         base_weight_bytes=family.base_weight_bytes(), load_memory=self.load_memory,
                         # every network's weights on this process (rank 0): under ZeRO-3 its partitions
                         held_weight_bytes=held_weight_bytes(self.generator.module, *(f.module for f in self.fakes),
                                                             getattr(self.teacher, "module", self.teacher)),
                         memory_plan=self.memory_plan.as_event(), gradient_checkpointing=t.gradient_checkpointing,
                         student_steps=dd.student_steps, student_sigmas=self.sigmas,
                         student_sampler=STUDENT_SAMPLER, student_scheduler=STUDENT_SCHEDULER,
                         resumed_from=str(resumed_from) if resumed_from else None)
        self.health = HealthLog(self.run_dir, self.is_rank0)
        if spec.samples.every:  # the student in its own step count, as the stock graph samples it
            student = dataclasses.replace(spec.samples, steps=dd.student_steps, cfg=1.0, sampler=STUDENT_SAMPLER,
                                          scheduler=STUDENT_SCHEDULER)
            self.control.previews = PreviewSampler(student, family, self.run_dir, self.is_rank0)

    def report_step(self, step: int, start_step: int, batch, lr: float, losses: dict, grad_norm, step_time: float):
        eta_s = self.control.timed(step, step_time)
        self.events.emit("step", step=step, total=self.spec.train.steps, lr=lr, grad_norm=grad_norm,
                         fake_lr=self.fake_optimizer.param_groups[0]["lr"],
                         samples_per_s=self.global_batch / step_time, step_time_s=step_time, eta_s=eta_s, **losses)
        self.health.step(step, **{f"train/{k}": v for k, v in losses.items()}, **{
            "train/lr": lr, "train/grad_norm": grad_norm, "perf/step_time_s": step_time})

    # --- one generator update ------------------------------------------------------------------------------
    def update(self, step: int, micro_batches) -> tuple[dict, float | None]:
        """The generator's update (sub-step 0), then the fake score's updates (sub-steps 1..fake_updates), the
        first on the generator's own outputs; with a fake score per student step, each of its updates on fresh
        outputs of that step. (The step's losses, global means; the generator's gradient norm.)"""
        dd, t = self.spec.distill, self.spec.train
        regression = step <= dd.regression_steps
        sums = {"generator": 0.0, "dmd": 0.0, "gan": 0.0, "fake": 0.0}
        model_shape = None
        inputs = []
        for m, micro in enumerate(micro_batches):
            latents = self.generator_family.prepare_latents(micro.latents.to(self.device).float())
            model_shape = tuple(latents.shape[1:])
            inputs.append((m, latents, micro.cond.to(self.device),
                           micro.pooled.to(self.device) if micro.pooled is not None else None,
                           micro.references.to(self.device) if micro.references is not None else None))
        outputs, own_norm, engine = [], None, self.generator.engine
        for m, latents, cond, pooled, references in inputs:
            # the GAN term passes through the fake score, whose weights it leaves alone: frozen until its backward
            # pass is done (a checkpointed block recomputes with the requires_grad it finds then)
            with frozen(self.fake_params if dd.gan_weight > 0 and not regression else []):
                x0, parts = self.generator_loss(step, m, model_shape, latents, cond, pooled, references, regression)
                engine.backward(parts["generator"])
            if engine.is_gradient_accumulation_boundary() and t.precision == "fp32":
                # ZeRO, bf16 and fp16 report theirs (fp16's model gradients are loss-scaled); else the Trainer's own
                own_norm = grad_norm(self.params)
            engine.step()
            outputs.append(x0.detach())
            for name, value in parts.items():
                sums[name] += value.detach()
        for sub in range(1, dd.fake_updates + 1):
            for k, fake in enumerate(self.fakes):
                # a fake score per student step: each on outputs of its own step, from draws of its own (samples
                # of one chain shared by every step's fake score measured worse: 0.52x against 0.46x, seed 0)
                draw = sub * len(self.fakes) + k if len(self.fakes) > 1 else sub
                for m, latents, cond, pooled, references in inputs:
                    if sub == 1 and len(self.fakes) == 1:
                        x0 = outputs[m]
                    else:
                        with torch.no_grad():
                            x0 = self.student_x0(step, draw, m, model_shape, latents, cond, pooled, references,
                                                 only_step=k if len(self.fakes) > 1 else None)[0]
                    loss = self.fake_loss(step, draw, m, model_shape, x0, latents, cond, pooled, references, fake)
                    fake.engine.backward(loss)
                    fake.engine.step()
                    sums["fake"] += loss.detach() / (dd.fake_updates * len(self.fakes))
        names = list(sums)
        local = torch.stack([torch.as_tensor(sums[n], dtype=torch.float64).cpu() for n in names]).tolist()
        means = (global_sum(local, self.device) / (len(micro_batches) * world_size())).tolist()
        out = dict(zip(names, means))
        losses = {"loss": out["generator"], "generator_loss": out["generator"], "fake_loss": out["fake"]}
        if regression:
            losses["regression_loss"] = out["generator"]
        else:
            losses["dmd_loss"] = out["dmd"]
        if dd.gan_weight > 0 and not regression:
            losses["gan_loss"] = out["gan"]
        reported = engine.get_global_grad_norm()
        return losses, float(reported) if reported else (own_norm.item() if own_norm is not None else None)
