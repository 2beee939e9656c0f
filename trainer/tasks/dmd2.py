"""DMD2's objective (distill.py's module docstring gives the algorithm): the student's noise levels, each draw of
an update seeded by (train.seed, a stream, the update, the sub-step) over the whole global batch, the student's x0
with backward simulation, the generator's regression, DMD and GAN losses, and the fake score's loss."""
from __future__ import annotations

import math

import torch

from ..data.loading import seeded_generator, stack_conds

# generator streams (data/loading.py uses 1-4, data/batch_mix 11-13): one per kind of draw
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
    from ..comfy_compat import scheduler_sigmas
    return [float(s) for s in scheduler_sigmas(model_sampling, STUDENT_SCHEDULER, steps)[:-1]]


def starts_at_max_noise(model_sampling, sigma: float) -> bool:
    """KSampler's max_denoise: its first sigma at the schedule's top scales the noise by sqrt(1 + sigma^2)."""
    max_sigma = float(model_sampling.sigma_max)
    return math.isclose(max_sigma, sigma, rel_tol=1e-05) or sigma > max_sigma


class DMD2Objective:
    """The losses of one generator update, as methods of the Distiller (its networks, slots, sigmas and device)."""

    # --- draws ---------------------------------------------------------------------------------------------
    def draw_normal(self, shape, *key) -> torch.Tensor:
        """Standard normal draws for the whole global batch (slice with self.slots)."""
        return torch.randn((self.global_batch, *shape), generator=seeded_generator(self.spec.train.seed, *key))

    def draw_uniform(self, *key) -> torch.Tensor:
        return torch.rand((self.global_batch,), generator=seeded_generator(self.spec.train.seed, *key))

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

    def fake_loss(self, step, sub, m, shape, x0, latents, cond, pooled, references, fake):
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
