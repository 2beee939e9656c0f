"""Random-weight models at real size, for benches: the full SD1.5 checkpoint and the full SDXL UNet.

    python tools/realsize_models.py --sd15 realsize_sd15.safetensors --sdxl realsize_sdxl_unet.safetensors
                                    [--dtype fp16|bf16|fp32] [--seed 0]

- SD1.5 (--sd15): one checkpoint with the whole SD1.5 architecture, as Load Checkpoint reads it: the 860M UNet
  (`model.diffusion_model.*`), the CLIP-L text encoder (`cond_stage_model.transformer.*`, 123M) and the KL VAE
  (`first_stage_model.*`, 84M). 2.1 GB in fp16.
- SDXL (--sdxl): the 2.6B SDXL UNet alone, as Load Diffusion Model reads it (bare UNet keys). 5.1 GB in fp16.
  Its text encoders (CLIP-L + CLIP-G) are not built: tests and benches use the synthetic ones of
  tests/comfy_nodes/ingraph_test_nodes.

The layouts come from ComfyUI's own model classes built on the meta device (no memory), with the UNet
configurations ComfyUI's detection maps SD1.5 and SDXL to, so ComfyUI detects the files as those models.
The file is written tensor by tensor (the safetensors header first, then each tensor as it is generated), so
building never holds more than one tensor: a 5 GB file needs a few hundred MB of memory.
Weights are fan-in scaled normals, norms 1, biases 0 (trainer/models/base.py init_weights): random but a
trainable, finite start. Their values mean nothing; sizes, keys, dtypes and timings are what they are for.
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

DTYPES = ("fp16", "bf16", "fp32")
SAFETENSORS_DTYPE = {"fp16": "F16", "bf16": "BF16", "fp32": "F32"}


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


def random_tensor(name: str, shape, generator, dtype):
    """Fan-in scaled normal for matrices and convolutions, 1 for norm weights, 0 for biases."""
    import torch
    if len(shape) >= 2:
        return (torch.randn(shape, generator=generator) / math.sqrt(math.prod(shape[1:]))).to(dtype)
    if name.endswith(("weight", "scale")):
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def write_random_safetensors(layout: dict, out: Path, dtype: str = "fp16", seed: int = 0,
                             metadata: dict | None = None) -> Path:
    """Writes a safetensors file with the layout's keys and shapes, random values, one tensor in memory at a time.

    The format: 8-byte little-endian header length, a JSON header (dtype, shape, byte range of each tensor),
    then the tensors' bytes back to back. Written to a temporary name, then renamed: a crash leaves no
    half-written file under the final name."""
    import torch
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    element = torch.tensor([], dtype=torch_dtype).element_size()
    header, offset = {}, 0
    for key, tensor in layout.items():
        size = math.prod(tensor.shape) * element
        header[key] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    generator = torch.Generator().manual_seed(seed)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, tensor in layout.items():
            value = random_tensor(key, tuple(tensor.shape), generator, torch_dtype).contiguous()
            f.write(value.reshape(-1).view(torch.uint8).numpy().tobytes())
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sd15", type=Path, help="write the full SD1.5 checkpoint (UNet + CLIP-L + KL VAE) here")
    parser.add_argument("--sdxl", type=Path, help="write the full SDXL UNet (a diffusion-model file) here")
    parser.add_argument("--dtype", default="fp16", choices=DTYPES, help="dtype on disk (default fp16)")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    if not (opts.sd15 or opts.sdxl):
        parser.error("nothing to build: give --sd15 OUT and/or --sdxl OUT")
    if opts.sd15:
        print(build_sd15(opts.sd15, opts.seed, opts.dtype))
    if opts.sdxl:
        print(build_sdxl_unet(opts.sdxl, opts.seed, opts.dtype))


if __name__ == "__main__":
    main()
