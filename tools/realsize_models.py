"""Random-weight models at real size, for benches: the full SD1.5 and SDXL checkpoints, the SDXL UNet alone and the
Flux.1-dev diffusion model.

    python tools/realsize_models.py --sd15 realsize_sd15.safetensors --sdxl realsize_sdxl_unet.safetensors
                                    --sdxl-checkpoint realsize_sdxl.safetensors --flux realsize_flux_fp8.safetensors
                                    [--dtype fp16|bf16|fp32|fp8] [--flux-blocks 19,38] [--values normal|pool] [--seed 0]

- SD1.5 (--sd15): one checkpoint with the whole SD1.5 architecture, as Load Checkpoint reads it: the 860M UNet
  (`model.diffusion_model.*`), the CLIP-L text encoder (`cond_stage_model.transformer.*`, 123M) and the KL VAE
  (`first_stage_model.*`, 84M). 2.1 GB in fp16.
- SDXL (--sdxl): the 2.6B SDXL UNet alone, as Load Diffusion Model reads it (bare UNet keys). 5.1 GB in fp16.
- SDXL (--sdxl-checkpoint): the whole SDXL base checkpoint, as Load Checkpoint reads it: the UNet, CLIP-L
  (`conditioner.embedders.0.*`) and OpenCLIP bigG (`conditioner.embedders.1.model.*`, 695M) in the layout ComfyUI saves
  them in, and the KL VAE. 6.9 GB in fp16.
- Flux (--flux): the 11.9B Flux.1-dev diffusion model (guidance embedding included), as Load Diffusion Model reads
  it; --flux-blocks D,S builds it with D double and S single blocks at the full width (ComfyUI's detection reads the
  width from no weight, so only the depth can shrink). With --dtype fp8 it is 11.9 GB: the matrices in
  float8_e4m3fn, norms and biases in bf16, as the fp8 files people generate with.

The layouts come from ComfyUI's own model classes built on the meta device (no memory), with the UNet
configurations ComfyUI's detection maps SD1.5 and SDXL to, so ComfyUI detects the files as those models.
The file is written tensor by tensor (the safetensors header first, then each tensor as it is generated), so
building never holds more than one tensor: a 5 GB file needs a few hundred MB of memory.
Weights are fan-in scaled normals, norms 1, biases 0 (trainer/models/base.py init_weights): random but a
trainable, finite start. Their values mean nothing; sizes, keys, dtypes and timings are what they are for.
--values pool draws every matrix from one seeded pool of 64M normals (a slice at a random place) instead of drawing
each anew: a 12B-parameter file is then written at the disk's speed rather than the random generator's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.prepare_run import _bootstrap  # noqa: E402  (ComfyUI on sys.path, the pack as ingraph_trainer)

# ComfyUI's configurations for the real models (comfy/model_detection.py, unet_config_from_diffusers_unet)
SD15_UNET_CONFIG = dict(
    image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[2, 2, 2, 2],
    channel_mult=[1, 2, 4, 4], transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0], transformer_depth_middle=1,
    transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], num_heads=8, context_dim=768,
    use_spatial_transformer=True, use_linear_in_transformer=False, legacy=False, adm_in_channels=None,
    use_temporal_attention=False, use_temporal_resblock=False,
)
SDXL_UNET_CONFIG = dict(
    image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[2, 2, 2],
    channel_mult=[1, 2, 4], transformer_depth=[0, 0, 2, 2, 10, 10], transformer_depth_middle=10,
    transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], num_head_channels=64, context_dim=2048,
    adm_in_channels=2816, num_classes="sequential", use_spatial_transformer=True, use_linear_in_transformer=True,
    legacy=False, use_temporal_attention=False, use_temporal_resblock=False,
)
# the SD1.x KL VAE, as comfy.sd.VAE builds it for a `first_stage_model` with these keys
KL_VAE_DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                   "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}

DTYPES = ("fp16", "bf16", "fp32", "fp8")
SAFETENSORS_DTYPE = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}
VALUES = ("normal", "pool")
POOL_SIZE = 64 * 2 ** 20


def _meta_state(module_factory) -> dict:
    """The state dict (keys and shapes, no storage) of the module a factory builds."""
    import torch
    with torch.device("meta"):
        module = module_factory()
    buffers = [name for name, _ in module.named_buffers()]
    if buffers:  # their values would have to be real, not random: none of these models has any today
        raise RuntimeError(f"{type(module).__name__} has buffers {buffers[:5]}: the builder only makes parameters")
    return module.state_dict()


def _unet(config: dict):
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    return UNetModel(**config, operations=comfy.ops.disable_weight_init)


def sd15_layout() -> dict:
    """Checkpoint key -> meta tensor for the whole SD1.5 checkpoint (UNet, CLIP-L, KL VAE)."""
    _bootstrap()
    import torch
    import comfy.sd1_clip
    from comfy.ldm.models.autoencoder import AutoencoderKL
    layout = {}
    for key, tensor in _meta_state(lambda: _unet(SD15_UNET_CONFIG)).items():
        layout[f"model.diffusion_model.{key}"] = tensor
    clip = _meta_state(lambda: comfy.sd1_clip.SDClipModel(device="meta", dtype=torch.float16).transformer)
    for key, tensor in clip.items():
        if key != "text_projection.weight":  # SD1.5 files have none (ComfyUI's SD15 drops it when saving)
            layout[f"cond_stage_model.transformer.{key}"] = tensor
    for key, tensor in _meta_state(lambda: AutoencoderKL(ddconfig=dict(KL_VAE_DDCONFIG), embed_dim=4)).items():
        layout[f"first_stage_model.{key}"] = tensor
    return layout


def sdxl_unet_layout() -> dict:
    """Diffusion-model key -> meta tensor for the full SDXL UNet (bare keys, as Load Diffusion Model reads)."""
    _bootstrap()
    return dict(_meta_state(lambda: _unet(SDXL_UNET_CONFIG)))


def sdxl_layout() -> dict:
    """Checkpoint key -> meta tensor for the whole SDXL base checkpoint (UNet, CLIP-L, OpenCLIP bigG, KL VAE), the
    text encoders in the layout ComfyUI's SDXL saves them in (its own conversion, run on meta tensors)."""
    _bootstrap()
    import torch
    import comfy.sdxl_clip
    import comfy.supported_models
    from comfy.ldm.models.autoencoder import AutoencoderKL
    layout = {f"model.diffusion_model.{k}": v for k, v in sdxl_unet_layout().items()}
    clip = _meta_state(lambda: comfy.sdxl_clip.SDXLClipModel(device="meta", dtype=torch.float16))
    saved = comfy.supported_models.SDXL(SDXL_UNET_CONFIG).process_clip_state_dict_for_saving(clip)
    # position_ids is an index buffer (ComfyUI adds it when saving; its loader never reads it): not random weights
    layout.update((k, v) for k, v in saved.items() if not k.endswith("position_ids"))
    for key, tensor in _meta_state(lambda: AutoencoderKL(ddconfig=dict(KL_VAE_DDCONFIG), embed_dim=4)).items():
        layout[f"first_stage_model.{key}"] = tensor
    return layout


def flux_layout(double: int = 19, single: int = 38) -> dict:
    """Diffusion-model key -> meta tensor for Flux.1-dev with `double` and `single` blocks (19 and 38: the model),
    configured by ComfyUI's own detection (each version adds its own fields) from the few keys it reads."""
    _bootstrap()
    import torch
    import comfy.model_detection
    import comfy.ops
    from comfy.ldm.flux.model import Flux
    with torch.device("meta"):
        keys = {"img_in.weight": torch.empty(3072, 64), "vector_in.in_layer.weight": torch.empty(3072, 768),
                "txt_in.weight": torch.empty(3072, 4096), "guidance_in.in_layer.weight": torch.empty(3072, 256)}
        keys.update((f"double_blocks.{i}.img_attn.norm.key_norm.scale", torch.empty(128)) for i in range(double))
        keys.update((f"single_blocks.{i}.linear1.weight", torch.empty(21504, 3072)) for i in range(single))
    config = comfy.model_detection.detect_unet_config(keys, "")
    return dict(_meta_state(lambda: Flux(**config, operations=comfy.ops.disable_weight_init)))


def stored_dtype(shape, dtype: str):
    """The dtype a tensor of `shape` is written in: `dtype`, but bf16 for fp8's norms, biases and scalars."""
    import torch
    if dtype == "fp8":
        return torch.float8_e4m3fn if len(shape) >= 2 else torch.bfloat16
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]


class ValuePool:
    """One seeded pool of normals; each draw is a slice of it at a random place (tiled where longer)."""

    def __init__(self, generator):
        import torch
        self.generator = generator
        self.values = torch.randn(POOL_SIZE, generator=generator)

    def normal(self, shape):
        import torch
        n = math.prod(shape)
        if n > POOL_SIZE:
            return self.values.repeat(-(-n // POOL_SIZE))[:n].reshape(shape)
        start = int(torch.randint(0, POOL_SIZE - n + 1, (1,), generator=self.generator))
        return self.values[start:start + n].reshape(shape)


def random_tensor(name: str, shape, generator, dtype, pool: ValuePool | None = None):
    """Fan-in scaled normal for matrices and convolutions, 1 for norm weights, 0 for biases."""
    import torch
    if len(shape) >= 2:
        normal = pool.normal(shape) if pool is not None else torch.randn(shape, generator=generator)
        return (normal / math.sqrt(math.prod(shape[1:]))).to(dtype)
    if name.endswith(("weight", "scale")):
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def write_random_safetensors(layout: dict, out: Path, dtype: str = "fp16", seed: int = 0,
                             metadata: dict | None = None, values: str = "normal") -> Path:
    """Writes a safetensors file with the layout's keys and shapes, random values, one tensor in memory at a time.

    The format: 8-byte little-endian header length, a JSON header (dtype, shape, byte range of each tensor),
    then the tensors' bytes back to back. Written to a temporary name, then renamed: a crash leaves no
    half-written file under the final name."""
    import torch
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if values not in VALUES:
        raise ValueError(f"--values: {values!r} is not one of {', '.join(VALUES)}")
    header, offset = {}, 0
    for key, tensor in layout.items():
        stored = stored_dtype(tuple(tensor.shape), dtype)
        size = math.prod(tensor.shape) * stored.itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPE[str(stored).removeprefix("torch.")], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    generator = torch.Generator().manual_seed(seed)
    pool = ValuePool(generator) if values == "pool" else None
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, tensor in layout.items():
            shape = tuple(tensor.shape)
            value = random_tensor(key, shape, generator, stored_dtype(shape, dtype), pool).contiguous()
            f.write(value.reshape(-1).view(torch.uint8).numpy().data)
        written = f.tell()
    expected = 8 + len(raw) + offset
    if written != expected:
        tmp.unlink()
        raise RuntimeError(f"{out}: wrote {written} bytes, the header describes {expected}")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    return out


def parameter_count(layout: dict, prefix: str = "") -> int:
    return sum(math.prod(t.shape) for k, t in layout.items() if k.startswith(prefix))


def build_sd15(out: Path, seed: int = 0, dtype: str = "fp16") -> Path:
    return write_random_safetensors(sd15_layout(), out, dtype, seed,
                                    {"ingraph_realsize": "sd15 random weights", "seed": str(seed)})


def build_sdxl_unet(out: Path, seed: int = 0, dtype: str = "fp16") -> Path:
    return write_random_safetensors(sdxl_unet_layout(), out, dtype, seed,
                                    {"ingraph_realsize": "sdxl unet random weights", "seed": str(seed)})


def build_sdxl(out: Path, seed: int = 0, dtype: str = "fp16", values: str = "normal") -> Path:
    return write_random_safetensors(sdxl_layout(), out, dtype, seed,
                                    {"ingraph_realsize": "sdxl random weights", "seed": str(seed)}, values)


def build_flux(out: Path, seed: int = 0, dtype: str = "fp8", blocks: tuple[int, int] = (19, 38),
               values: str = "pool") -> Path:
    return write_random_safetensors(flux_layout(*blocks), out, dtype, seed,
                                    {"ingraph_realsize": f"flux dev random weights, {blocks[0]}+{blocks[1]} blocks",
                                     "seed": str(seed)}, values)


def block_counts(text: str) -> tuple[int, int]:
    try:
        double, single = (int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give the double and single block counts, e.g. 19,38") from None
    if double < 1 or single < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: at least one double block, and no negative count")
    return double, single


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sd15", type=Path, help="write the full SD1.5 checkpoint (UNet + CLIP-L + KL VAE) here")
    parser.add_argument("--sdxl", type=Path, help="write the full SDXL UNet (a diffusion-model file) here")
    parser.add_argument("--sdxl-checkpoint", type=Path,
                        help="write the whole SDXL checkpoint (UNet + CLIP-L + CLIP-G + KL VAE) here")
    parser.add_argument("--flux", type=Path, help="write the Flux.1-dev diffusion model here (fp8 unless --dtype)")
    parser.add_argument("--flux-blocks", type=block_counts, default=(19, 38),
                        help="Flux's double and single block counts (default 19,38: the model)")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="dtype on disk (default fp16; fp8 for --flux): fp8 writes the matrices in float8_e4m3fn")
    parser.add_argument("--values", default=None, choices=VALUES,
                        help="normal: each tensor drawn anew (default; pool for --flux): slices of one seeded pool")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    if not (opts.sd15 or opts.sdxl or opts.sdxl_checkpoint or opts.flux):
        parser.error("nothing to build: give --sd15, --sdxl, --sdxl-checkpoint and/or --flux OUT")
    dtype, values = opts.dtype or "fp16", opts.values or "normal"
    if opts.sd15:
        print(build_sd15(opts.sd15, opts.seed, dtype))
    if opts.sdxl:
        print(build_sdxl_unet(opts.sdxl, opts.seed, dtype))
    if opts.sdxl_checkpoint:
        print(build_sdxl(opts.sdxl_checkpoint, opts.seed, dtype, values))
    if opts.flux:
        print(build_flux(opts.flux, opts.seed, opts.dtype or "fp8", opts.flux_blocks, opts.values or "pool"))


if __name__ == "__main__":
    main()
