"""DMD2 few-step distillation (task "distill"), built from the adapter trainer's components (trainer/loop.py).

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

import contextlib
import dataclasses
import math
import time
from pathlib import Path

import torch

from .adapters import inject_adapter
from .batch_mix import StepBatches, build_training_data, micro_batch_slots
from .dataset_checks import reads_text_masks
from .checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from .comfy_env import import_comfy
from .data import seeded_generator, stack_conds, step_loader
from .device import training_device
from .distributed import data_parallel_size, deepspeed_config, world_size
from .layouts import ParallelLayout, WholeModel, choose_engine, global_sum, grad_norm
from .loop import check_finite, refuse_fp8_full_fine_tune
from .memory import checkpointed_with_fp8_kept, load_peak
from .memory_plan import plan_distillation
from .metrics import HealthLog
from .models import Batch, load_family
from .optim import averaged_weights, build_optimizer, build_scheduler
from .result import write_result
from .run_control import RunControl, TrainingTask
from .sampling import PreviewSampler

# generator streams (data.py uses 1-4, batch_mix 11-13): one per kind of draw
STUDENT_STEP_STREAM = 21  # which student step each slot trains
START_NOISE_STREAM = 22  # the noise the student's input is made from
SIMULATION_NOISE_STREAM = 23  # backward simulation: the fresh noise of each re-noising
DMD_TIME_STREAM = 24  # where the DMD gradient (and the fake score's loss) is taken
DMD_NOISE_STREAM = 25
FAKE_TIME_STREAM = 26
FAKE_NOISE_STREAM = 27

STUDENT_SAMPLER, STUDENT_SCHEDULER = "lcm", "sgm_uniform"  # what samples the student (module docstring)


def student_sigmas(model_sampling, steps: int, timesteps: list) -> list[float]:
    """The student's noise levels, highest first: ComfyUI's own sgm_uniform sigmas for `steps` (what KSampler
    visits), or explicit places t in (0, 1] along the model's schedule."""
    if timesteps:
        return [float(model_sampling.sigma_max) if t >= 1.0 else float(model_sampling.percent_to_sigma(1.0 - t))
                for t in timesteps]
    from .comfy_compat import scheduler_sigmas
    return [float(s) for s in scheduler_sigmas(model_sampling, STUDENT_SCHEDULER, steps)[:-1]]


def starts_at_max_noise(model_sampling, sigma: float) -> bool:
    """KSampler's max_denoise: its first sigma at the schedule's top scales the noise by sqrt(1 + sigma^2)."""
    max_sigma = float(model_sampling.sigma_max)
    return math.isclose(max_sigma, sigma, rel_tol=1e-05) or sigma > max_sigma


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
        out = self.diffusion_model(x_in.to(dtype), sampling.timestep(sigma).float(), transformer_options={}, **kwargs)
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
    from .os_support import host_memory
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


class Distiller(TrainingTask):
    # --- building ------------------------------------------------------------------------------------------
    def load(self, precision: str):
        family = load_family(self.spec.model, precision=precision)
        t = self.spec.train
        family.set_objective(t.loss, t.huber_delta, t.min_snr_gamma, t.flow_shift, t.guidance)
        return family

    def trainable(self, family, seed: int) -> list:
        """The network's trainable weights: its adapter of the spec's kind (seeded), or every weight."""
        a = self.spec.adapter
        if a.kind == "full":
            refuse_fp8_full_fine_tune(family.diffusion_model, self.spec.model.path)
            return list(family.diffusion_model.requires_grad_(True).parameters())
        torch.manual_seed(seed)
        return inject_adapter(family.diffusion_model, self.targets, a.kind, a.rank, a.alpha, a.dropout)

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
        if reads_text_masks(generator, self.dataset):  # the networks are called without Batch.text_mask
            raise ValueError(f"data.manifest: its captions carry the text encoder's attention mask, which "
                             f"{generator.display_name} reads; distilling it with the mask is not yet supported")
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
                channels = fake.base_model.latent_format.latent_channels
                head = GanHead(channels).to(fake.weight_dtype())
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
    def train(self):
        t = self.spec.train
        start_step, resumed_from = self.control.resume(self.started_at)
        self.announce(start_step, resumed_from)
        loader = step_loader(self.batches, self.device)
        stopped, losses = False, {}
        for step in range(start_step + 1, t.steps + 1):
            self.step_in_flight = step
            t0 = time.perf_counter()
            batch = loader.get(step - 1, step if step < t.steps else None)
            lr = self.optimizer.param_groups[0]["lr"]
            losses, norm = self.update(step, batch.micro_batches)
            check_finite(step, losses["loss"], norm)
            check_finite(step, losses["fake_loss"], None)
            self.report_step(step, lr, norm, losses, time.perf_counter() - t0)
            if self.control.after_step(step):  # previews, stop, checkpoint
                stopped = True
                break
        else:
            step = t.steps
        loader.close()
        self.health.close()
        with averaged_weights(self.optimizer):
            adapter, replaced_kept = write_result(self.spec, self.generator_family, self.params, self.generator,
                                                  self.is_rank0, len(self.dataset.unique), step, self.started_at)
        self.events.emit("finished", adapter=adapter, replaced_kept=replaced_kept, steps=step, stopped=stopped, final_loss=losses.get("loss"),
                         eval_before=None, eval_after=None, best_eval_step=None, best_eval_loss=None,
                         mean_step_s=self.control.mean_step_s(), data_wait_s=0.0,
                         peak_rss_per_rank=peak_rss_per_rank(), wall_s=time.time() - self.started_at)
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

    def report_step(self, step: int, lr: float, grad_norm, losses: dict, step_time: float):
        eta_s = self.control.timed(step, step_time)
        self.events.emit("step", step=step, total=self.spec.train.steps, lr=lr, grad_norm=grad_norm,
                         fake_lr=self.fake_optimizer.param_groups[0]["lr"],
                         samples_per_s=self.global_batch / step_time, step_time_s=step_time, eta_s=eta_s, **losses)
        self.health.step(step, **{f"train/{k}": v for k, v in losses.items()}, **{
            "train/lr": lr, "train/grad_norm": grad_norm, "perf/step_time_s": step_time})

    # --- draws ---------------------------------------------------------------------------------------------
    def draw_normal(self, shape, *key) -> torch.Tensor:
        """Standard normal draws for the whole global batch (slice with self.slots)."""
        return torch.randn((self.global_batch, *shape), generator=seeded_generator(self.spec.train.seed, *key))

    def draw_uniform(self, *key) -> torch.Tensor:
        return torch.rand((self.global_batch,), generator=seeded_generator(self.spec.train.seed, *key))

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

    def student_x0(self, step: int, sub: int, m: int, shape, latents, cond, pooled, references,
                   from_dataset: bool = False, only_step: int | None = None):
        """(the student's x0 at its step k, its input, k): k drawn per slot (`only_step`: that step for every slot,
        as a step's own fake score takes it); the input at sigma_k is pure noise
        (k = 0), the student's own earlier steps from pure noise (backward simulation), or the dataset's latents
        noised (`from_dataset`, and k > 0 without backward simulation). Gradients flow as the caller's mode says."""
        dd, slots = self.spec.distill, self.slots[m]
        sampling = self.generator_family.base_model.model_sampling
        n = len(self.sigmas)
        every_k = (self.draw_uniform(STUDENT_STEP_STREAM, step, sub) * n).long().clamp(max=n - 1)
        if only_step is not None:
            every_k = torch.full_like(every_k, only_step)
        k = every_k[slots].to(self.device)
        sigmas = torch.tensor(self.sigmas, dtype=torch.float32, device=self.device)
        sigma_k = sigmas[k]
        noise = self.draw_normal(shape, START_NOISE_STREAM, step, sub)[slots].to(self.device)
        view = (-1,) + (1,) * len(shape)
        noised_data = sampling.noise_scaling(sigma_k.view(view), noise, latents)
        if from_dataset:
            x = noised_data
        else:
            pure = sampling.noise_scaling(sigmas[0].view(1), noise, torch.zeros_like(noise), self.first_at_max)
            x = torch.where((k == 0).view(view), pure, noised_data)
            # as many student steps on every process (under ZeRO-3 each forward pass gathers weights collectively):
            # the deepest step of the global batch
            deepest = int(every_k.max())
            if dd.backward_simulation and deepest > 0:
                with torch.no_grad():
                    current = pure
                    for j in range(deepest):
                        denoised = self.generator.engine("x0", current, sigmas[j].expand(len(k)), cond, pooled,
                                                         references)
                        fresh = self.draw_normal(shape, SIMULATION_NOISE_STREAM, step, sub, j)[slots].to(self.device)
                        current = sampling.noise_scaling(sigmas[j + 1].view(1), fresh, denoised)
                        x = torch.where((k == j + 1).view(view), current, x)
        return self.generator.engine("x0", x, sigma_k, cond, pooled, references), x, k

    def generator_loss(self, step, m, shape, latents, cond, pooled, references, regression: bool):
        """(the student's x0, {"generator": the loss to back-propagate, "dmd", "gan": its parts})."""
        dd = self.spec.distill
        x0, _, k = self.student_x0(step, 0, m, shape, latents, cond, pooled, references, from_dataset=regression)
        zero = torch.zeros((), device=self.device)
        if regression:
            loss = torch.nn.functional.mse_loss(x0.float(), latents.float())
            return x0, {"generator": loss, "dmd": zero, "gan": zero}
        slots = self.slots[m]
        sampling = self.generator_family.base_model.model_sampling
        t_place = dd.min_t + (dd.max_t - dd.min_t) * self.draw_uniform(DMD_TIME_STREAM, step, 0)[slots]
        sigma_t = self.generator_family.sigmas(t_place).to(self.device)
        noise = self.draw_normal(shape, DMD_NOISE_STREAM, step, 0)[slots].to(self.device)
        view = (-1,) + (1,) * len(shape)
        with torch.no_grad():
            x_t = sampling.noise_scaling(sigma_t.view(view), noise, x0.detach())
            real = self.real_x0(x_t, sigma_t, cond, pooled, references)
            fake = self.fake_x0(x_t, sigma_t, cond, pooled, references, k)
            dims = tuple(range(1, x0.dim()))
            normaliser = (x0.detach().float() - real).abs().mean(dim=dims, keepdim=True)
            grad = torch.nan_to_num((fake - real) / normaliser)
        dmd = 0.5 * torch.nn.functional.mse_loss(x0.float(), (x0.float() - grad).detach())
        loss = dd.dmd_weight * dmd
        gan = zero
        if dd.gan_weight > 0:  # through the fake score's module (frozen by the caller), not its engine, which
            # takes any backward pass through its outputs for its own
            x_t_grad = sampling.noise_scaling(sigma_t.view(view), noise, x0)
            gan = torch.nn.functional.softplus(-self.fake.engine.module("logit", x_t_grad, sigma_t, cond, pooled,
                                                                        references)).mean()
            loss = loss + dd.gan_weight * gan
        return x0, {"generator": loss, "dmd": dmd, "gan": gan}

    def fake_x0(self, x_t, sigma_t, cond, pooled, references, k):
        """The fake score's x0; with one per student step, each sample's from the fake score of the step that made
        it (every fake score runs on the whole batch: under ZeRO-3 a forward pass is collective)."""
        if len(self.fakes) == 1:
            return self.fake.engine("x0", x_t, sigma_t, cond, pooled, references)
        every = torch.stack([f.engine("x0", x_t, sigma_t, cond, pooled, references) for f in self.fakes])
        return every[k, torch.arange(x_t.shape[0], device=every.device)]

    def real_x0(self, x_t, sigma_t, cond, pooled, references):
        """The teacher's x0, guided: uncond + guidance_scale * (cond - uncond), with the empty caption."""
        scale = self.spec.distill.guidance_scale
        cond_x0 = self.teacher("x0", x_t, sigma_t, cond, pooled, references)
        if scale == 1.0:
            return cond_x0
        count = x_t.shape[0]
        empty_cond = stack_conds([self.empty_text["cond"]] * count).to(self.device)
        empty_pooled = torch.stack([self.empty_text["pooled"]] * count).to(self.device) \
            if pooled is not None and "pooled" in self.empty_text else None
        uncond_x0 = self.teacher("x0", x_t, sigma_t, empty_cond, empty_pooled, references)
        return uncond_x0 + scale * (cond_x0 - uncond_x0)

    def fake_loss(self, step, sub, m, shape, x0, latents, cond, pooled, references, fake: Network):
        """The fake score's loss on the generator's detached x0: the family's own training loss with x0 as the
        clean latents (times denoising_weight), plus the GAN classifier's loss where on."""
        dd, slots = self.spec.distill, self.slots[m]
        family = self.fake_family
        t_place = dd.min_t + (dd.max_t - dd.min_t) * self.draw_uniform(FAKE_TIME_STREAM, step, sub)[slots]
        noise = self.draw_normal(shape, FAKE_NOISE_STREAM, step, sub)[slots].to(self.device)
        raw = family.base_model.process_latent_out(x0.detach().float())  # the family's loss takes cached latents
        per_sample = fake.engine("loss", raw, cond, pooled, noise, t_place.to(self.device), references)
        loss = dd.denoising_weight * per_sample.mean()
        if dd.gan_weight > 0:
            sampling = family.base_model.model_sampling
            sigma_t = family.sigmas(t_place).to(self.device)
            view = (-1,) + (1,) * len(shape)
            generated = sampling.noise_scaling(sigma_t.view(view), noise, x0.detach())
            real = sampling.noise_scaling(sigma_t.view(view), noise, latents)
            softplus = torch.nn.functional.softplus
            loss = loss + dd.gan_weight * (
                softplus(fake.engine("logit", generated, sigma_t, cond, pooled, references)).mean()
                + softplus(-fake.engine("logit", real, sigma_t, cond, pooled, references)).mean())
        return loss
