"""Sample previews from the ComfyUI side: prompts encoded with the graph's CLIP, handed to the trainer as files."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..trainer.spec import SampleSpec

CONDITIONING_FILE = "sample_conditioning.safetensors"


@dataclass
class PreviewSettings:
    """What the Sample Previews node outputs: the settings plus encoded prompts and the VAE object."""
    spec: SampleSpec
    conditioning: dict = field(default_factory=dict)  # flat tensors: positive.<i>.cond, negative.cond, ...
    vae: object = None


def encode_prompt(clip, text: str) -> list:
    """ComfyUI conditioning for one prompt, as CLIP Text Encode makes it."""
    return clip.encode_from_tokens_scheduled(clip.tokenize(text))


def encode_prompts(clip, prompts: list[str], negative: str) -> dict:
    from ..trainer.sampling import conditioning_tensors
    tensors = conditioning_tensors(encode_prompt(clip, negative), "negative")
    for i, prompt in enumerate(prompts):
        tensors.update(conditioning_tensors(encode_prompt(clip, prompt), f"positive.{i}"))
    return tensors


def write_preview_inputs(settings: PreviewSettings, run_dir: Path, vae) -> SampleSpec:
    """The conditioning into the run directory; returns the spec part, the VAE read from `vae`
    (runner.model_source.VaeSource: a VAE file, or the checkpoint it came from)."""
    import dataclasses

    from safetensors.torch import save_file
    if vae is None:
        raise ValueError("previews: no VAE source given (runner.model_source.hand_off_vae)")
    path = Path(run_dir) / CONDITIONING_FILE
    save_file(settings.conditioning, str(path))
    return dataclasses.replace(settings.spec, conditioning=str(path), vae_path=str(vae.path), vae_format=vae.format)
