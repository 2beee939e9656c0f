"""A random-weight Wan 2.1 VAE that ComfyUI's VAELoader detects as one (its video VAE: 16 latent channels, 4x in
time, 8x in space), for tests of video datasets. ComfyUI fixes its size (127M parameters; stored in fp16, 254 MB),
so it is built, not shrunk.

    python tools/tiny_wan_vae.py OUT.safetensors
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.prepare_run import _bootstrap  # noqa: E402  (ComfyUI on sys.path, the pack as ingraph_trainer)
from tools.tiny_models import _save  # noqa: E402


def build_wan_vae(out: Path, seed: int = 3) -> Path:
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


if __name__ == "__main__":
    print(build_wan_vae(Path(sys.argv[1])))
