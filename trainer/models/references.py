"""Reference images handed to an edit model as ComfyUI's ReferenceLatent node hands them at inference.

ReferenceLatent (and TextEncodeQwenImageEdit) append the encoded image to the conditioning's
`reference_latents`; the model's extra_conds turns them into `ref_latents` (each through process_latent_in) and
the diffusion model appends their patches to the image sequence. A family mixing this in gives its extra_conds the
batch's reference latents the same way, so an adapter trained on edit pairs works in the stock edit workflow.
"""
from __future__ import annotations

import torch

from .base import Batch


class ReferenceLatentsInput:
    """Mixin for families whose ComfyUI model takes `reference_latents` (Flux Kontext, Qwen-Image-Edit). Place it
    before the ModelFamily base class. A batch without references trains the plain text-to-image model."""

    reference_input = "reference_latents"

    def extra_cond_inputs(self, batch: Batch, x_noisy: torch.Tensor) -> dict:
        inputs = super().extra_cond_inputs(batch, x_noisy)
        if batch.references:
            # the raw cached latent in the model's layout (a Wan-VAE family's one-frame video), as VAEEncode gives it
            inputs["reference_latents"] = [self.to_model_layout(ref.float()) for ref in batch.references]
        return inputs

    def model_kwargs(self, batch: Batch, x_noisy: torch.Tensor, dtype) -> dict:
        # ComfyUI's _apply_model casts every floating-point tensor of a list condition (ref_latents) to the
        # model's dtype and device, as it does single tensors
        out = super().model_kwargs(batch, x_noisy, dtype)
        for name, value in out.items():
            if isinstance(value, list):
                out[name] = [v.to(x_noisy.device, dtype if v.is_floating_point() else v.dtype)
                             if isinstance(v, torch.Tensor) else v for v in value]
        return out


def with_references(process_img, image, image_ids, references, method: str, index_step: float = 1,
                    negative: bool = False, uxo_origin: tuple[int, int] | None = None):
    """(image tokens, positions) with each reference latent's patches and positions appended, as ComfyUI's Flux and
    Qwen-Image forwards append them (the first pipeline stage does the same), made by the model's own `process_img`
    at the place reference_places gives."""
    for ref, (index, h_offset, w_offset) in zip(references, reference_places(references, method, index_step, negative,
                                                                             uxo_origin)):
        patches, ids = process_img(ref, index=index, h_offset=h_offset, w_offset=w_offset)[:2]  # Qwen's: a 3rd
        image, image_ids = torch.cat([image, patches], dim=1), torch.cat([image_ids, ids], dim=1)
    return image, image_ids


def reference_places(references, method: str, index_step: float = 1, negative: bool = False,
                     uxo_origin: tuple[int, int] | None = None) -> list[tuple[float, int, int]]:
    """(index, h_offset, w_offset) of each reference latent, as ComfyUI's Flux and Qwen-Image forwards place their
    patches beside the image's: at the next index (each `index_step` on, Flux.2's 10), the previous one down
    (`negative`: Qwen-Image's negative_index on 0.33), beyond the image (Flux's "uxo", `uxo_origin` the image's
    padded height and width), or at index 1 beside the others."""
    h = w = index = 0
    places = []
    for ref in references:
        h_offset = w_offset = 0
        if method in ("index", "index_timestep_zero"):
            index += index_step
        elif negative and method == "negative_index":
            index -= 1
        elif uxo_origin is not None and method == "uxo":
            index, h_offset, w_offset = 0, uxo_origin[0] + h, uxo_origin[1] + w
            h, w = h + ref.shape[-2], w + ref.shape[-1]
        else:
            index = 1
            if ref.shape[-2] + h > ref.shape[-1] + w:
                w_offset = w
            else:
                h_offset = h
            h, w = max(h, ref.shape[-2] + h_offset), max(w, ref.shape[-1] + w_offset)
        places.append((index, h_offset, w_offset))
    return places
