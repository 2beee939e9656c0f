"""The model-family interface: what the trainer needs from each family of diffusion model.

Every family is rebuilt with ComfyUI's own code, so the conditioning a family needs (SDXL's size
embedding, Flux's guidance, SD3's pooled vector) comes from ComfyUI's `extra_conds`, exactly as its
samplers build it, and the noise schedule from ComfyUI's `model_sampling`. A family says only what
differs: which layers take adapters, which blocks checkpoint, how latents are laid out, and how a
model of it is built from scratch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..adapters import FP8_DTYPES
from ..spec import PREDICTIONS as SPEC_PREDICTIONS

PREDICTIONS = tuple(p for p in SPEC_PREDICTIONS if p != "auto")


@dataclass
class Batch:
    latents: torch.Tensor  # raw VAE latents, as cached (family applies its latent format)
    cond: torch.Tensor  # text-encoder hidden states
    pooled: torch.Tensor | None
    noise: torch.Tensor
    timesteps: torch.Tensor  # in [0, 1): where on the noise schedule each sample lies (0 = clean)
    mask: torch.Tensor | None = None  # loss weights per latent pixel, [B, 1, (1,) h, w] as cached; None: all 1
    # reference images of each item as raw VAE latents, one tensor per reference slot ([B, C, (T,) h, w] as
    # cached); a family whose `reference_input` is set hands them to its model as ComfyUI's conditioning nodes do
    references: list[torch.Tensor] | None = None
    # the text encoder's attention mask, as cached beside the embedding ([B, tokens], 1 on a token, 0 on padding),
    # or None (no padding); a family whose ComfyUI model reads it (LTX-Video, HunyuanDiT) hands it to extra_conds
    text_mask: torch.Tensor | None = None
    # what the text encoder returned beside the embedding, pooled vector and mask, by the names ComfyUI's encoder
    # gave them (HunyuanDiT's conditioning_mt5xl, Anima's t5xxl_ids ...; data.loading.TextExtras), or None; the
    # conditioning CLIPTextEncode makes holds them, and extra_conds is given them as the sampler gives them
    text_extras: dict | None = None
    # the items' audio latents, cached beside their clips' video latents ([B, C, T, F] as the audio VAE gives them),
    # and the noise drawn for them: a joint audio-video model's second stream (LTX-2's); None where the dataset has
    # no audio, or the family takes none
    audio: torch.Tensor | None = None
    audio_noise: torch.Tensor | None = None


def is_comfy_model(base_model, class_name: str) -> bool:
    """Whether ComfyUI's model is exactly comfy.model_base.<class_name> (a family's match: never a subclass, which
    is another family's); False on a ComfyUI that has no such class (0.3.64 has no Flux2, Krea2, HunyuanVideo15)."""
    import comfy.model_base
    model_class = getattr(comfy.model_base, class_name, None)
    return model_class is not None and type(base_model) is model_class


class UnsupportedSetting(ValueError):
    """A run setting this model family cannot honour; the message names the setting."""


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's timestep shift: more of the schedule at high noise when shift > 1."""
    return u if shift == 1.0 else shift * u / (1.0 + (shift - 1.0) * u)


class ModelFamily:
    """One family of diffusion model: load, adapter targets, layers, conditioning, loss."""

    name = "base"
    display_name = "base"
    base_model_version = "unknown"  # kohya ss_base_model_version
    target_patterns: dict[str, tuple[str, ...]] = {}
    diffusers_format = False  # whether the diffusers (peft) LoRA layout exists for this family
    latent_ndim = 4  # dims of a latent batch the diffusion model takes (5: video models, B C T H W)
    latent_channels: int | None = None  # of the (video) latents its model takes; None: its latent format's (its VAE's)
    text_input_layer: str | None = None  # (regex) the first layer taking the text embedding: its width; None: unread
    pooled_input_layer: str | None = None  # (regex) the layer taking the pooled text vector: its width; None: unread
    pooled_read_in_part = False  # whether its model reads the first part of a wider pooled vector (Flux's y[:, :768])
    # how the model takes an item's reference images (Batch.references): None (it takes none),
    # "reference_latents" (Flux Kontext, Qwen-Image-Edit: ComfyUI's ReferenceLatent conditioning) or
    # "start_image" (Wan image-to-video: the concat latent and mask WanImageToVideo builds)
    reference_input: str | None = None
    frame_rate = 0.0  # the dataset's clips' frame rate (read_dataset), for a family whose conditioning takes one
    # the text encoder's extra outputs (Batch.text_extras) without which the model cannot run: a dataset whose
    # captions lack them (encoded by another text encoder) is refused before the first step
    text_extras_needed: tuple[str, ...] = ()
    # whether the model's extra_conds reads the text encoder's attention mask (Batch.text_mask), which it is then
    # handed where cached (batch_mix refuses pipeline stages, which do not carry it)
    reads_text_mask = False
    # whether the model takes an audio stream beside the video (Batch.audio; a dataset with it is refused without)
    takes_audio = False
    needs_audio = False  # whether its model always generates sound (MiniMax H3): a dataset without any is refused
    reads_timestep_value = False  # whether its forward reads it (MiniMax H3's): the memory plan's meta pass gives it

    def __init__(self, base_model, prediction: str, patcher=None):
        self.loss_kind, self.huber_delta, self.min_snr_gamma = "mse", 0.1, 0.0  # see set_objective
        self.flow_shift, self.guidance = 1.0, 1.0
        self.base_model = base_model
        self.patcher = patcher  # ComfyUI's ModelPatcher around base_model (what its samplers take)
        self.diffusion_model = base_model.diffusion_model
        self.compute_dtype = None  # train.precision's dtype (load_family sets it); None: the weights' own dtype
        if prediction not in PREDICTIONS:
            raise ValueError(f"model.prediction: {prediction!r} is not one of {PREDICTIONS}")
        self.prediction = prediction
        # Cosmos Predict2's rectified flow (ComfyUI 0.33's COSMOS_RFLOW) names a flow time t by its EDM sigma,
        # t / (1 - t): the same noising, input and velocity target as plain flow, reached through that sigma
        self.flow_by_edm_sigma = prediction == "flow" and any(
            c.__name__ == "COSMOS_RFLOW" for c in type(getattr(base_model, "model_sampling", None)).__mro__)

    @classmethod
    def matches(cls, base_model) -> bool:
        raise NotImplementedError

    # Constructing a family and checking settings read the model and change nothing: the ComfyUI process builds
    # one on the graph's live MODEL. What the trainer must change in the model's modules happens here, called by
    # load_family on the trainer's own copy.
    def prepare_for_training(self) -> None:
        """Patches the trainer's copy of the model's modules for training (once); ComfyUI's ops are told they train
        (comfy_compat.enter_training), and comfy-kitchen's rotary ops, which some models call all the same, get a
        backward (kitchen_autograd)."""
        from ..comfy_compat import enter_training
        from ..kitchen_autograd import register_backwards
        enter_training()
        register_backwards()

    def weight_dtype(self) -> torch.dtype:
        """The dtype the model computes in: compute_dtype, else the first parameter not stored in fp8 (fp8 bases
        are cast layer by layer to the input's dtype by ComfyUI's ops), else float32."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        for param in self.diffusion_model.parameters():
            if param.is_floating_point() and param.dtype not in FP8_DTYPES:
                return param.dtype
        return torch.float32

    def base_weight_bytes(self) -> int:
        """Storage bytes of the frozen base weights (parameters and buffers of the diffusion model, adapter
        tensors excluded): halves from bf16 to fp8."""
        from ..adapters import is_adapter_tensor
        from ..comfy_compat import tensor_bytes
        tensors = [*self.diffusion_model.named_parameters(), *self.diffusion_model.named_buffers()]
        return sum(tensor_bytes(t) for name, t in tensors if not is_adapter_tensor(name))

    # --- what a run may ask of this family -------------------------------------------------------------
    def check_settings(self, spec) -> None:
        """Raises UnsupportedSetting for run settings this family cannot honour (checked by the node and
        again by the trainer, so a hand-written spec gets the same message)."""
        t = spec.train
        self.check_quantized_weights(spec)
        if self.prediction != "flow" and t.flow_shift != 1.0:
            raise UnsupportedSetting(f"train.flow_shift: {self.display_name} is not a flow-matching model "
                                     f"({self.prediction}); leave the shift at 1")
        if spec.distributed.pipeline_stages > 1:
            self.pipeline_layers()  # raises, naming the setting, where the family (or variant) does not split
        if spec.output.format == "diffusers" and not self.diffusers_format:
            raise UnsupportedSetting(f"output.format: the diffusers layout is for SD1.x/SD2.x/SDXL UNets, not "
                                     f"{self.display_name}; use comfyui or kohya")

    def image_size_problem(self, width: int, height: int) -> str | None:
        """Why the model cannot run on items of this size (pixels), or None (trainer.data.dataset_checks)."""
        return None

    def check_quantized_weights(self, spec) -> None:
        """A model loaded from a quantized file (ComfyUI 0.33's layouts) trains a LoRA, on a device that runs its
        layouts: refused naming the layer, layout and device otherwise, before anything starts."""
        from ..comfy_compat import layout_problem, quantized_layouts
        layouts = quantized_layouts(self.diffusion_model)
        if not layouts:
            return
        layout, layer = next(iter(layouts.items()))
        if spec.adapter.kind != "lora":
            raise UnsupportedSetting(f"adapter.kind: {spec.adapter.kind} is not trained on quantized weights ({layer} "
                                     f"is stored as {layout}); train a LoRA on this model, or load it from a file in "
                                     "full precision")
        from ..device import training_device
        device = training_device()
        for layout, layer in layouts.items():
            problem = layout_problem(layout, device)
            if problem:
                raise UnsupportedSetting(f"model: {layer} is stored as {layout}, which does not run on {device} "
                                         f"({problem}); load the model from a file in another layout or precision")

    # --- adapters and memory ---------------------------------------------------------------------------
    def adapter_targets(self, preset: str, kind: str = "lora") -> list[str]:
        """Names (relative to the diffusion model) of the layers an adapter preset trains: linear layers, and
        convolutions too for "all_layers" (ComfyUI's Conv ops are torch's Conv classes, which peft adapts: LoRA
        any, LoHa and LoKr 1-D and 2-D ones only, so a video model's 3-D patch embedding gets a LoRA alone)."""
        from ..comfy_compat import is_linear
        if preset == "all_layers":
            conv = (torch.nn.Conv1d, torch.nn.Conv2d) + ((torch.nn.Conv3d,) if kind in ("lora", "dora") else ())
            return [n for n, m in self.diffusion_model.named_modules() if is_linear(m) or isinstance(m, conv)]
        linear = [n for n, m in self.diffusion_model.named_modules() if is_linear(m)]
        if preset == "all_linear":
            return linear
        patterns = [re.compile(p) for p in self.preset_patterns(preset)]
        return [n for n in linear if any(p.search(n) for p in patterns)]

    def preset_patterns(self, preset: str) -> tuple[str, ...]:
        """The layer-name patterns of a named adapter preset (target_patterns'), for this run."""
        return self.target_patterns[preset]

    def checkpoint_blocks(self) -> list[torch.nn.Module]:
        """Blocks whose activations gradient checkpointing recomputes."""
        raise NotImplementedError

    def read_dataset(self, dataset) -> None:
        """What the model's conditioning takes from the run's dataset (its training images where prior images are
        mixed in): its clips' frame rate (0: images)."""
        self.frame_rate = float(getattr(getattr(dataset, "main", dataset), "fps", 0.0) or 0.0)

    # --- objective -------------------------------------------------------------------------------------
    def set_objective(self, loss: str = "mse", huber_delta: float = 0.1, min_snr_gamma: float = 0.0,
                      flow_shift: float = 1.0, guidance: float = 1.0):
        """How the training loss is computed; evaluation (weighted=False) always uses plain MSE."""
        self.loss_kind, self.huber_delta, self.min_snr_gamma = loss, huber_delta, min_snr_gamma
        self.flow_shift, self.guidance = flow_shift, guidance

    def to_model_layout(self, latents: torch.Tensor) -> torch.Tensor:
        """A latent batch in the model's layout: 4-D as 1-frame videos for a video-latent model (not a dataset's)."""
        return latents.unsqueeze(2) if latents.dim() == 4 and self.latent_ndim == 5 else latents

    def prepare_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.base_model.process_latent_in(self.to_model_layout(latents))

    def sigmas(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Noise level (ComfyUI's sigma) of each sample from its place on the schedule (0 = clean, towards 1 = pure
        noise): the flow time itself for flow models, Cosmos's EDM sigma of it, a discrete schedule's sigma."""
        if self.prediction == "flow":
            t = shifted(timesteps.float().clamp(1e-4, 1.0 - 1e-4), self.flow_shift)
            if self.flow_by_edm_sigma:  # up to the schedule's top, as ComfyUI's sampler starts there
                return (t / (1.0 - t)).clamp(max=float(self.base_model.model_sampling.sigma_max))
            return t
        sampling = self.base_model.model_sampling  # ComfyUI's discrete schedule: index from the fraction
        t = (timesteps * len(sampling.sigmas)).long().clamp(0, len(sampling.sigmas) - 1)
        return sampling.sigmas[t.cpu()].to(timesteps.device).float()

    def model_kwargs(self, batch: Batch, x_noisy: torch.Tensor, dtype) -> dict:
        """The diffusion model's conditioning inputs, built by ComfyUI's own extra_conds (as its samplers do)."""
        conds = self.base_model.extra_conds(**self.extra_cond_inputs(batch, x_noisy))
        out = {}
        for name, cond in conds.items():
            if hasattr(cond, "process_cond"):
                value = cond.process_cond(batch_size=x_noisy.shape[0], area=None, device=x_noisy.device).cond
            else:
                value = cond
            if isinstance(value, torch.Tensor):
                value = value.to(x_noisy.device, dtype if value.is_floating_point() else value.dtype)
            out[name] = value
        out["context"] = out.pop("c_crossattn", None)
        return out

    @staticmethod
    def whole_text_mask(batch: Batch, device) -> torch.Tensor:
        """The text attention mask [1, tokens] that ComfyUI's encoders hand extra_conds for a model that counts its
        text's tokens from it (per conditioning, batch 1: Lumina 2's, Omnigen2's): the cached embeddings hold every
        token, so all ones."""
        return torch.ones((1, batch.cond.shape[1]), dtype=torch.long, device=device)

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        """What extra_conds is given: the cached text embedding (and pooled vector, and the text encoder's extras:
        Batch.text_extras), the noisy latent, its size and the prompt type as the sampler gives them, and
        for a model that concatenates an image to its input (ComfyUI's concat_keys: HunyuanVideo's image-to-video,
        inpainting models) the sampler's latent_image as an empty latent gives it, which concat_cond falls back on
        where the trainer has no image to give."""
        inputs = {"noise": x_noisy, "device": x_noisy.device, "cross_attn": batch.cond, "prompt_type": "positive",
                  # the size ComfyUI's sampler gives every extra_conds (samplers.encode_model_conds), read off the
                  # noisy latent's axes 3 and 2 whatever the model's layout (PixArt's and HunyuanDiT's size inputs)
                  # (none for a packed latent of several streams, [B, 1, N]: an audio-video model's)
                  "width": x_noisy.shape[3] * 8 if x_noisy.dim() >= 4 else None, "height": x_noisy.shape[2] * 8}
        if getattr(self.base_model, "concat_keys", ()):
            inputs["latent_image"] = self.base_model.process_latent_in(torch.zeros_like(x_noisy))
        # CLIPTextEncode's conditioning always carries it, None from an encoder with none (T5's, an LLM's): an
        # extra_conds that reads it unconditionally (ComfyUI 0.3.64's Flux and its Chroma kin, HunyuanVideo) gets None
        inputs["pooled_output"] = batch.pooled
        if self.reads_text_mask and batch.text_mask is not None:
            inputs["attention_mask"] = batch.text_mask
        return {**(batch.text_extras or {}), **inputs}

    def target(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        if self.prediction == "flow":  # rectified flow: the model predicts the velocity noise - x0
            return noise - x0
        if self.prediction == "v_prediction":
            return (noise - sigma * x0) / (sigma ** 2 + 1.0).sqrt()
        if self.prediction == "v_prediction_ddpm":  # the output ComfyUI's V_PREDICTION_DDPM turns into x0 from its
            return (x0 + sigma * noise - x0 * (sigma ** 2 + 1.0).sqrt()) / sigma  # input, the unscaled x0 + sigma noise
        return noise

    def snr(self, sigma: torch.Tensor) -> torch.Tensor:
        if self.flow_by_edm_sigma:
            return 1.0 / sigma ** 2  # ((1 - t) / t) ** 2 at t = sigma / (sigma + 1)
        if self.prediction == "flow":
            return ((1.0 - sigma) / sigma) ** 2
        return 1.0 / sigma ** 2  # alpha_bar / (1 - alpha_bar) on ComfyUI's schedule

    def training_loss(self, prediction: torch.Tensor, target: torch.Tensor, snr: torch.Tensor,
                      weighted: bool, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample loss: the configured objective when `weighted`, else plain MSE; mask-weighted per latent
        pixel where a mask is given (in the prediction's layout)."""
        from ..objectives import min_snr_weight, per_sample_loss
        if not weighted:
            return per_sample_loss(prediction, target, mask=mask)
        loss = per_sample_loss(prediction, target, self.loss_kind, self.huber_delta, mask=mask)
        if self.min_snr_gamma > 0:
            loss = loss * min_snr_weight(snr.float(), self.min_snr_gamma, self.prediction)
        return loss

    def model_inputs(self, batch: Batch):
        """What the diffusion model is called with, the way ComfyUI's apply_model prepares it (input scaling,
        timestep, conditioning): (x_in, timestep, kwargs)."""
        sampling = self.base_model.model_sampling
        dtype = self.weight_dtype()
        x0, noise, sigma = self.noising(batch.latents, batch.noise, batch.timesteps)
        shape = (-1,) + (1,) * (x0.dim() - 1)
        x_noisy = sampling.noise_scaling(sigma.view(shape), noise, x0)
        x_in = sampling.calculate_input(sigma.view(shape), x_noisy)
        kwargs = self.model_kwargs(batch, x_noisy, dtype)
        c_concat = kwargs.pop("c_concat", None)
        if c_concat is not None:
            x_in = torch.cat([x_in, c_concat.to(x_in.dtype)], dim=1)
        return x_in.to(dtype), sampling.timestep(sigma).float(), kwargs

    def noising(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor):
        """(clean latents in the model's layout and scale, noise in that layout, sigma per sample)."""
        x0 = self.prepare_latents(latents.float())
        return x0, self.to_model_layout(noise.float()), self.sigmas(timesteps).to(x0.device)

    def loss_of_output(self, out: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                       reduce: bool = True, weighted: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of the model's raw output against the family's target for these latents and noise."""
        x0, noise, sigma = self.noising(latents, noise, timesteps)
        shape = (-1,) + (1,) * (x0.dim() - 1)
        mask = self.to_model_layout(mask) if mask is not None else None  # a video model's frame axis
        per_sample = self.training_loss(out, self.target(x0, noise, sigma.view(shape)), self.snr(sigma), weighted,
                                        mask)
        return per_sample.mean() if reduce else per_sample

    def model_output(self, batch: Batch) -> torch.Tensor:
        """The diffusion model's raw output on a batch, called as ComfyUI's apply_model calls it."""
        return self.run_model(*self.model_inputs(batch))

    def run_model(self, x_in: torch.Tensor, timestep: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The diffusion model called on model_inputs' (x_in, timestep, kwargs), as ComfyUI's apply_model calls it
        (training and distillation both call it here)."""
        return self.diffusion_model(x_in, timestep, transformer_options=self.transformer_options(kwargs), **kwargs)

    def transformer_options(self, kwargs: dict) -> dict:
        """The transformer_options ComfyUI's own apply_model of this model class adds (model_inputs' kwargs given)."""
        return {}

    def loss(self, batch: Batch, reduce: bool = True, weighted: bool = True) -> torch.Tensor:
        """The diffusion loss of a batch: noised with ComfyUI's noise scaling, run as ComfyUI runs the model."""
        return self.loss_of_output(self.model_output(batch), batch.latents, batch.noise, batch.timesteps, reduce,
                                   weighted, batch.mask)

    def pipeline_layers(self) -> list[torch.nn.Module]:
        """The model as a sequence of layers for pipeline stages: each takes and returns a tuple of tensors;
        the first takes pipeline.micro_batch's inputs (stages.StageInput), the last returns the raw model output."""
        raise UnsupportedSetting(f"distributed.pipeline_stages: {self.display_name} models do not split into "
                                 "pipeline stages yet (SD UNets, SDXL, SD3, Flux, Flux.2, Chroma, Qwen-Image, Lumina 2 "
                                 "and Z-Image, Krea 2, Wan, HunyuanVideo 1 and 1.5, LTX-Video and LTX-2 do); use 1 "
                                 "stage")

    # --- building a model of this family from scratch ----------------------------------------------------
    scratch_sizes: dict[str, dict] = {}  # named sizes for the New Model node: {"tiny": {...}, ...}

    @classmethod
    def scratch_size_for_text(cls, size: dict, text_width: int, pooled_width: int | None) -> dict:
        """A from-scratch size that takes the caption embeddings of a given text encoder (widths of its
        hidden states and pooled vector); raises UnsupportedSetting where the family's widths are fixed."""
        return size

    @classmethod
    def scratch_state_dict(cls, seed: int = 0, **size) -> dict[str, torch.Tensor]:
        """Random-initialised weights (ComfyUI keys) of a model of this family that ComfyUI detects as it."""
        raise NotImplementedError(f"{cls.display_name}: training from scratch is not offered for this family")


def init_weights(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fan-in scaled normal weights, unit norms, zero biases: a trainable random start (ComfyUI's model
    classes skip initialisation)."""
    import math
    generator = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        with torch.no_grad():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(math.prod(param.shape[1:])))
            elif name.endswith(("weight", "scale")):
                param.fill_(1.0)
            else:
                param.zero_()
    return module


def random_state_dict(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The state dict of `module` given init_weights' random start, each tensor contiguous (as a file holds it): a
    family's scratch_state_dict, and the coverage tool's builders."""
    return {k: v.contiguous() for k, v in init_weights(module, seed).state_dict().items()}


def block_lists(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of every ModuleList directly under the model (transformer blocks of most DiTs)."""
    return [block for child in module.children() if isinstance(child, torch.nn.ModuleList) for block in child]
