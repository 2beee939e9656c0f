"""The memory plan (trainer/parallel/memory_plan.py) of real-size models on an NVIDIA card, computed here without a GPU and
without weights: each model is built by ComfyUI's own classes on the meta device, with the configuration ComfyUI
detects for the real file, a LoRA is injected, and the plan's meta pass runs with ComfyUI's attention for NVIDIA
cards (PyTorch's scaled_dot_product_attention). Planned, not measured: bench/memory_plan.py compares plans with
measured peaks (on this CPU; on a GPU through scripts/gpu_smoke.sh's memory stage).

    python tools/plan_memory_table.py [--cards 12 16 24] [--markdown]

LoRA rank 16 on the attention and feed-forward layers, at the starting graphs' sizes and batches. Prints, per model
and setting, the planned peak and its parts, and what memory "auto" chooses on each card size
(the card's memory x 0.9 less 0.5 GiB for the CUDA context and ComfyUI's own allocations: a stand-in for "free").
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.realsize_models import SD15_UNET_CONFIG, SDXL_UNET_CONFIG, _bootstrap  # noqa: E402

GiB = 2 ** 30
CONTEXT_GIB = 0.5
# ComfyUI's detection of Flux dev's file (comfy/model_detection.py): 19 double and 38 single blocks, 11.9B
FLUX_DEV_CONFIG = dict(image_model="flux", in_channels=16, patch_size=2, out_channels=16, vec_in_dim=768,
                       context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19,
                       depth_single_blocks=38, axes_dim=[16, 56, 56], theta=10000, qkv_bias=True,
                       guidance_embed=True)


def models():
    """name -> (ComfyUI model config class, unet config, inputs(batch, side) -> (x, timestep, kwargs))."""
    import torch
    import comfy.supported_models as sm

    def unet_inputs(text: int, pooled: int | None):
        def make(batch: int, side: int):
            kwargs = {"context": torch.zeros(batch, 77, text)}
            if pooled:
                kwargs["y"] = torch.zeros(batch, pooled)
            return torch.zeros(batch, 4, side // 8, side // 8), torch.full((batch,), 500.0), kwargs
        return make

    def flux_inputs(batch: int, side: int):
        return (torch.zeros(batch, 16, side // 8, side // 8), torch.full((batch,), 0.5),
                {"context": torch.zeros(batch, 512, 4096), "y": torch.zeros(batch, 768),
                 "guidance": torch.full((batch,), 3.5)})
    return {"SD1.5": (sm.SD15, dict(SD15_UNET_CONFIG), unet_inputs(768, None)),
            "SDXL": (sm.SDXL, dict(SDXL_UNET_CONFIG), unet_inputs(2048, 2816)),
            "Flux dev": (sm.Flux, dict(FLUX_DEV_CONFIG), flux_inputs)}


def build(config_class, unet_config: dict, fp8: bool):
    import torch
    from ingraph_trainer.trainer.adapters import FP8_DTYPES, inject_adapter
    from ingraph_trainer.trainer.models import family_for
    model_config = config_class(unet_config)
    with torch.device("meta"):
        base = model_config.get_model({}, "", device=torch.device("meta"))
    family = family_for(base)
    if fp8:  # what UNETLoader's fp8_e4m3fn holds: matrices and convolutions in fp8
        for module in family.diffusion_model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and module.weight.dtype not in FP8_DTYPES:
                module.weight.data = torch.empty(module.weight.shape, dtype=torch.float8_e4m3fn, device="meta")
                module.comfy_cast_weights = True  # as ComfyUI's loader sets it: cast to the input's dtype per call
    torch.manual_seed(0)
    # the starting graphs' adapter (tools/starting_graphs.py): rank 16 on the attention and feed-forward layers
    inject_adapter(family.diffusion_model, family.adapter_targets("attention_ff"), "lora", 16, 16.0, 0.0)
    return family


@contextlib.contextmanager
def nvidia_attention(comfy_attention):
    """Within: ComfyUI's attention is the one it picks on NVIDIA cards (PyTorch's scaled_dot_product_attention), in
    its attention module and in every model module that imported the function by name (Flux's math, say)."""
    chosen = comfy_attention.optimized_attention
    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("comfy.") and getattr(m, "optimized_attention", None) is chosen]
    for module in holders:
        module.optimized_attention = comfy_attention.attention_pytorch
    try:
        yield
    finally:
        for module in holders:
            module.optimized_attention = chosen


def plans(name: str, side: int, fp8: bool, cards: list[float], batch: int = 1) -> list[dict]:
    import torch
    import comfy.ldm.modules.attention as comfy_attention
    from ingraph_trainer.trainer.parallel import memory_plan as mp
    from ingraph_trainer.trainer.parallel.memory_sizes import activation_profile, model_bytes
    from ingraph_trainer.trainer.spec import RunSpec
    config_class, unet_config, inputs = models()[name]
    family = build(config_class, unet_config, fp8)
    blocks = family.checkpoint_blocks()
    with nvidia_attention(comfy_attention):
        profile = activation_profile(family, inputs(batch, side), blocks, torch.bfloat16, torch.device("cpu"))
    weights = model_bytes(family.diffusion_model, blocks, torch.bfloat16)
    spec = RunSpec()
    spec.train.precision = "bf16"
    rows = []
    for checkpointing in (False, True):
        plan = mp.plan_for(spec, weights, profile, checkpointing, 0, "cuda", None)
        rows.append({"model": name, "side": side, "batch": batch, "base": "fp8" if fp8 else "bf16", "setting":
                     f"checkpointing {'on' if checkpointing else 'off'}", "peak": plan.peak, "parts": plan.parts})
    spec.train.memory = "auto"
    for card in cards:
        budget = int((card * mp.MARGIN - CONTEXT_GIB) * GiB)
        plan = mp.choose(spec, weights, profile, "cuda", budget)
        choice = ("refused" if not plan.fits() else
                  f"checkpointing {'on' if plan.checkpointing else 'off'}"
                  + (f", {plan.block_swap} of {len(blocks)} blocks swapped" if plan.block_swap else ""))
        rows.append({"model": name, "side": side, "batch": batch, "base": "fp8" if fp8 else "bf16",
                     "setting": f"auto on a {card:g} GB card", "peak": plan.peak, "parts": plan.parts,
                     "choice": choice})
    return rows


# (model, side, fp8 base, batch): the starting graphs' sizes and batches
CASES = (("SD1.5", 512, False, 2), ("SDXL", 1024, False, 1), ("SDXL", 1024, True, 1), ("Flux dev", 1024, False, 1),
         ("Flux dev", 1024, True, 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cards", nargs="*", type=float, default=[12, 16, 24])
    parser.add_argument("--markdown", action="store_true", help="a table for the README")
    opts = parser.parse_args(argv)
    _bootstrap()
    rows = [row for name, side, fp8, batch in CASES for row in plans(name, side, fp8, opts.cards, batch)]
    if opts.markdown:
        print("| model | batch | base | setting | planned peak | chosen |")
        print("|---|---|---|---|---|---|")
    for r in rows:
        if opts.markdown:
            print(f"| {r['model']} {r['side']}² | {r['batch']} | {r['base']} | {r['setting']} | {r['peak'] / GiB:.1f} GiB | "
                  f"{r.get('choice', '')} |")
        else:
            parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in r["parts"].items() if v)
            print(f"{r['model']:8s} {r['side']}px x{r['batch']} {r['base']:4s} {r['setting']:26s} {r['peak'] / GiB:6.2f} GiB  "
                  f"{r.get('choice', '')}  ({parts})")


if __name__ == "__main__":
    main()
