"""Tiny random-weight diffusion models of every family, as files ComfyUI's UNETLoader detects as that
family, a 16-channel TAESD VAE for the flow-matching families' latents, and a Wan 2.1 VAE (tests and benches).

    python tools/tiny_models.py --family sd3 --out tiny_sd3.safetensors [--dtype bf16]
    python tools/tiny_models.py --families sdxl:bf16 sd3 flux:bf16 wan --out-dir DIR   # DIR/tiny_<family>.safetensors
    python tools/tiny_models.py --families flux2:bf16 z_image:bf16 --out-dir DIR   # ComfyUI 0.33's Flux.2, Z-Image
    python tools/tiny_models.py --vae16 tiny_taesd16.safetensors --vae4 tiny_taesd4.safetensors
    python tools/tiny_models.py --wan-vae tiny_wan_vae.safetensors

Sizes are each family's smallest that ComfyUI still detects (see trainer/models/<family>.py):
SD3 and Wan are well under a million parameters, SDXL ~60M (its text width and block depths are what
ComfyUI matches); Flux ~400M (one double block) cannot shrink further because ComfyUI
reads its width from a fixed configuration. The Wan VAE is not shrunk either: ComfyUI fixes its size (127M
parameters; stored in fp16, 254 MB).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.prepare_run import _bootstrap  # noqa: E402  (ComfyUI on sys.path, the pack as ingraph_trainer)


def _save(state: dict, out: Path, dtype=None):
    from tools.embedded_default import save_safetensors
    save_safetensors({k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
                      for k, v in state.items()}, out)


# models that ComfyUI loads as another family's class, by the name their tiny file takes (tiny_<name>.safetensors):
# name → (family, its scratch sizes beyond the size asked for); ComfyUI 0.33's, which 0.3.64 cannot build
VARIANTS = {"z_image": ("lumina2", dict(variant="z_image"))}


def build_family_model(family: str, out: Path, seed: int = 0, size: str = "tiny", dtype: str = "fp32") -> Path:
    """`family`: a family's name, or one of VARIANTS."""
    _bootstrap()
    import torch
    from ingraph_trainer.trainer.models import FAMILIES
    family, variant = VARIANTS.get(family, (family, {}))
    cls = next(c for c in FAMILIES if c.name == family)
    state = cls.scratch_state_dict(seed, **{**cls.scratch_sizes.get(size, {}), **variant})
    _save(state, out, {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    return out


def build_vae16(out: Path, seed: int = 2) -> Path:
    _bootstrap()
    import comfy.taesd.taesd
    from ingraph_trainer.trainer.models.base import init_weights
    taesd = init_weights(comfy.taesd.taesd.TAESD(latent_channels=16), seed)
    _save({k: v for k, v in taesd.state_dict().items() if k.startswith(("taesd_encoder.", "taesd_decoder."))}, out)
    return out


def build_wan_vae(out: Path, seed: int = 3) -> Path:
    """A random-weight Wan 2.1 VAE that ComfyUI's VAELoader detects as one (its video VAE: 16 latent channels, 4x in
    time, 8x in space), for tests of video datasets."""
    _bootstrap()
    import torch
    import comfy.ldm.wan.vae
    from ingraph_trainer.trainer.models.base import init_weights
    # the configuration comfy/sd.py builds for a state dict with decoder.middle.0.residual.0.gamma (Wan 2.1)
    vae = comfy.ldm.wan.vae.WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                   temperal_downsample=[False, True, True], dropout=0.0)
    init_weights(vae, seed)
    with torch.no_grad():
        for name, param in vae.named_parameters():
            if name.endswith("gamma"):  # RMS norms' scales
                param.fill_(1.0)
    _save(vae.state_dict(), out, torch.float16)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=["sd_unet", "sdxl", "sd3", "flux", "wan"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", nargs="*", default=[], metavar="FAMILY[:DTYPE]",
                        help="several families (or VARIANTS' names) in one go (one ComfyUI import), written to --out-dir")
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--vae16", type=Path, help="write a 16-channel TAESD VAE here")
    parser.add_argument("--vae4", type=Path, help="write a 4-channel TAESD VAE (SD1.x/SDXL latents) here")
    parser.add_argument("--wan-vae", type=Path, help="write a Wan 2.1 VAE (video latents) here")
    opts = parser.parse_args(argv)
    # the VAEs first (seconds; each file is seeded alone, so the order changes none): every module that waits on
    # the files written so far needs one of them, and the families in the order the tests first ask for them
    if opts.vae16:
        print(build_vae16(opts.vae16))
    if opts.vae4:
        from tools.embedded_default import build_vae
        print(build_vae(opts.vae4))
    if opts.wan_vae:
        print(build_wan_vae(opts.wan_vae))
    if opts.family:
        print(build_family_model(opts.family, opts.out, opts.seed, opts.size, opts.dtype))
    for item in opts.families:
        family, _, dtype = item.partition(":")
        print(build_family_model(family, opts.out_dir / f"tiny_{family}.safetensors", opts.seed, opts.size,
                                 dtype or "fp32"))


if __name__ == "__main__":
    main()
