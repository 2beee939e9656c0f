"""Build the embedded default: a tiny random-weight SD1.5-format checkpoint and a captioned image set.

Everything is generated locally from a seed (no downloads). The checkpoint is the smallest one
ComfyUI's stock CheckpointLoaderSimple detects as SD1.5 (see ../shared/DESIGN.md): one UNet
level with one res block and one transformer block, full CLIP-L text encoder stored in fp16,
and a TAESD VAE.

    python tools/embedded_default.py --checkpoint OUT.safetensors --images DIR [--count 8 --size 64]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

TINY_UNET_CONFIG = dict(
    image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[1], channel_mult=[1],
    transformer_depth=[1], transformer_depth_middle=-2,
    transformer_depth_output=[1, 1], num_head_channels=64, context_dim=768,
    use_spatial_transformer=True, use_linear_in_transformer=False, legacy=False,
    adm_in_channels=None, use_temporal_attention=False, use_temporal_resblock=False,
)

CAPTION_WORDS = ["red", "blue", "green", "yellow", "circle", "square", "stripes", "dots"]


def save_safetensors(state: dict, out: Path) -> Path:
    """`state` as a safetensors file at `out`, written by the pack's atomic write: a reader (a test server, a test
    waiting on the file while a background build goes on) sees no file or the whole one, never a part."""
    _bootstrap()
    from safetensors.torch import save_file
    from ingraph_trainer.cache.files import atomic_write
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out) as staged:
        save_file(state, str(staged.path))
    return out


def _bootstrap():
    """ComfyUI importable and the pack as the package ingraph_trainer (tools/bootstrap.py), after a clear exit
    where ComfyUI is missing. Run as a script, this file has tools/ on the path but not the repo."""
    path = Path(os.environ.get("COMFYUI_PATH", "/opt/ComfyUI"))
    if not (path / "comfy").is_dir():
        sys.exit(f"ComfyUI not found at {path} (set COMFYUI_PATH)")
    repo = str(Path(__file__).resolve().parent.parent)
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from tools.bootstrap import bootstrap
    bootstrap()


def _init_weights(module, generator):
    import torch
    for name, param in module.named_parameters():
        with torch.no_grad():
            if param.ndim >= 2:
                fan_in = math.prod(param.shape[1:])
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
            elif name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.zero_()


def build_checkpoint(out: Path, seed: int = 0) -> Path:
    _bootstrap()
    import torch
    from comfy.cli_args import args
    args.cpu = True
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    import comfy.sd1_clip
    import comfy.taesd.taesd
    import comfy.ops

    generator = torch.Generator().manual_seed(seed)
    unet = UNetModel(**TINY_UNET_CONFIG, operations=comfy.ops.disable_weight_init)
    _init_weights(unet, generator)
    clip = comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float32)
    _init_weights(clip, generator)
    taesd = comfy.taesd.taesd.TAESD()
    _init_weights(taesd, generator)

    state = {}
    for k, v in unet.state_dict().items():
        state[f"model.diffusion_model.{k}"] = v.to(torch.float32).contiguous()
    for k, v in clip.transformer.state_dict().items():
        state[f"cond_stage_model.transformer.{k}"] = v.to(torch.float16).contiguous()
    for k, v in taesd.state_dict().items():
        if k.startswith(("taesd_encoder.", "taesd_decoder.")):
            state[f"first_stage_model.{k}"] = v.to(torch.float32).contiguous()
    return save_safetensors(state, out)


def build_vae(out: Path, seed: int = 1) -> Path:
    """A TAESD VAE with other random weights than the checkpoint's: a "different VAE" for cache tests."""
    _bootstrap()
    import torch
    from comfy.cli_args import args
    args.cpu = not torch.cuda.is_available()
    import comfy.taesd.taesd
    taesd = comfy.taesd.taesd.TAESD()
    _init_weights(taesd, torch.Generator().manual_seed(seed))
    state = {k: v.contiguous() for k, v in taesd.state_dict().items() if k.startswith(("taesd_encoder.", "taesd_decoder."))}
    return save_safetensors(state, out)


def build_images(folder: Path, count: int = 8, size: int | tuple[int, int] = 64, seed: int = 0) -> list[Path]:
    """Simple coloured shapes with captions that describe them, so a LoRA has something to learn."""
    from PIL import Image, ImageDraw
    import random

    rng = random.Random(seed)
    colours = {"red": (220, 40, 40), "blue": (40, 60, 220), "green": (40, 180, 60), "yellow": (230, 210, 40)}
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i in range(count):
        colour = list(colours)[i % len(colours)]
        shape = ["circle", "square"][(i // len(colours)) % 2]
        w, h = (size, size) if isinstance(size, int) else size
        img = Image.new("RGB", (w, h), (rng.randint(200, 255),) * 3)
        draw = ImageDraw.Draw(img)
        side = min(w, h)
        a, b = rng.randint(4, side // 4), rng.randint(side // 2, side - 4)
        (draw.ellipse if shape == "circle" else draw.rectangle)([a, a, b, b], fill=colours[colour])
        path = folder / f"item_{i:03d}.png"
        img.save(path)
        path.with_suffix(".txt").write_text(f"a {colour} {shape}, ingraph style\n", encoding="utf-8")
        written.append(path)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="where to write the tiny SD1.5 checkpoint")
    parser.add_argument("--images", type=Path, help="folder to fill with captioned images")
    parser.add_argument("--vae", type=Path, help="write a TAESD VAE with other random weights here")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    if opts.checkpoint and not opts.checkpoint.exists():
        build_checkpoint(opts.checkpoint, opts.seed)
        print(f"checkpoint: {opts.checkpoint}")
    if opts.vae:
        build_vae(opts.vae, opts.seed)
        print(f"vae: {opts.vae}")
    if opts.images:
        build_images(opts.images, opts.count, opts.size, opts.seed)
        print(f"images: {opts.images}")


if __name__ == "__main__":
    main()
