"""The graph's MODEL as the runner asks about it: one view, built when a node's run begins
(runner.node_run.run_task) and asked for everything the runner needs of the MODEL: its objective and family (the
refusals), its weight patches and weights (the hand-off), releasing ComfyUI's loaded copy, and the MODEL with a
run's result applied. The MODEL (ComfyUI's ModelPatcher) crosses into the trainer's side once, here; the runner
never reaches into it, so what a ComfyUI change breaks is here or in comfy_compat."""
from __future__ import annotations

import functools


class GraphModel:
    def __init__(self, patcher):
        self._patcher = patcher

    @property
    def patcher(self):
        """The MODEL itself, for a node's output."""
        return self._patcher

    @functools.cached_property
    def prediction(self) -> str:
        """The objective the MODEL is configured for (a ModelSamplingDiscrete node upstream included); ValueError
        naming one the trainer has not (EDM, image-to-image flow...)."""
        from .models import prediction_from_sampling
        return prediction_from_sampling(self._patcher.get_model_object("model_sampling"))

    def family(self):
        """The MODEL's family (trainer.models), for the refusals before anything is written; ValueError where no
        family takes it."""
        from .models import family_for
        return family_for(self._patcher.model, prediction=self.prediction)

    # --- what the hand-off compares with the files the graph names --------------------------------------------

    @property
    def patches(self) -> dict:
        """The MODEL's weight patches (LoRA loaders, patch nodes) by key: empty for a model as its loader gave it."""
        return getattr(self._patcher, "patches", None) or {}

    @property
    def patches_uuid(self):
        """The identity of the MODEL's weight patches (kept by clones, changed by new patches)."""
        return getattr(self._patcher, "patches_uuid", None)

    def diffusion_parameters(self) -> dict | None:
        """The diffusion model's parameters by name as the MODEL holds them (unpatched once released), or None for
        a MODEL that holds none this way."""
        try:
            return dict(self._patcher.model.diffusion_model.named_parameters())
        except AttributeError:
            return None

    def weight_shapes(self) -> dict:
        """The diffusion model's state dict as held: its names, shapes and dtypes (patches change no shape)."""
        return self._patcher.model.diffusion_model.state_dict()

    def patched_state_dict(self) -> dict:
        """The diffusion-model weights with the MODEL's patches applied, computed tensor by tensor on the CPU the
        way ComfyUI's ModelPatcher.patch_weight_to_device does, without loading the model onto the device or
        changing it. Release ComfyUI's models first: a model ComfyUI holds loaded may carry its patches in place."""
        from .comfy_compat import patched_weight
        patcher = self._patcher
        if getattr(patcher.model, "current_weight_patches_uuid", None) is not None:
            patcher.unpatch_model()  # patched in place and still loaded: restore the originals before reading them
        state = {}
        for name, tensor in patcher.model.diffusion_model.state_dict().items():
            key = f"diffusion_model.{name}"
            if key not in patcher.patches:
                state[name] = tensor.detach()
                continue
            state[name] = patched_weight(patcher, key, patcher.patches[key])
        return state

    def config_metadata(self, weights: dict) -> dict[str, str]:
        """The "config" metadata a file of `weights` needs so that ComfyUI's loader builds this MODEL's class and
        sizes from it (trainer.models.file_metadata)."""
        from .models.file_metadata import config_metadata
        return config_metadata(self._patcher.model, weights)

    # --- before a run and after it ------------------------------------------------------------------------------

    def release(self) -> tuple[int, bool]:
        """Unloads ComfyUI's loaded models (diffusion model, encoders) and empties its cache, so the trainer gets
        the whole device; weights go back to their offload device, unpatched. (How many loaded models remain,
        whether this MODEL is among them.)"""
        from .comfy_compat import loaded_models, unload_all_models
        unload_all_models()
        remaining = loaded_models()
        held = any(getattr(loaded, "model", None) is not None and loaded.model.model is self._patcher.model
                   for loaded in remaining)
        return len(remaining), held

    def with_result(self, path: str, file_format: str, full: bool):
        """The MODEL with a run's output file applied the way ComfyUI's loaders apply it (lazily: nothing loads
        now): a full fine-tune replaces every weight and keeps the MODEL's own options (sampling, patches on top);
        an adapter is applied at strength 1, a diffusers-layout one converted first. A GraphModel of its own."""
        from .comfy_compat import load_tensors, with_lora
        from .export import comfyui_readable, diffusers_module_names
        tensors = load_tensors(path)
        if full:
            trained = self._patcher.clone()
            trained.add_patches({f"diffusion_model.{k}": ("set", (v,)) for k, v in tensors.items()}, 1.0, 0.0)
            return GraphModel(trained)
        if file_format == "diffusers":
            tensors = comfyui_readable(tensors, diffusers_module_names(self._patcher.model))
        return GraphModel(with_lora(self._patcher, tensors))
