"""Does diffusers read our adapter files as we meant them? (the test of the kohya and diffusers formats)

Builds a diffusers UNet2DConditionModel with the same weights as a ComfyUI SD1.x/2.x diffusion-model
file (names from ComfyUI's own unet_to_diffusers map), loads an adapter file the way diffusers'
load_lora_weights does (lora_state_dict + load_lora_into_unet), and compares its output with
ComfyUI's model with the same file applied by ComfyUI's LoRA loader (diffusers-layout attention
keys, which ComfyUI does not read, renamed back first). Prints one JSON line.

    python tools/diffusers_roundtrip.py --model MODEL.safetensors --adapter LORA.safetensors
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def diffusers_unet(base_model):
    """A diffusers UNet2DConditionModel with the ComfyUI UNet's configuration and weights."""
    import comfy.utils
    from diffusers import UNet2DConditionModel
    cfg = base_model.model_config.unet_config
    levels = len(cfg["channel_mult"])
    with_attention = [d > 0 for d in cfg["transformer_depth"][::cfg["num_res_blocks"][0]]][:levels] \
        if len(cfg["transformer_depth"]) >= levels else [True] * levels
    heads = cfg["num_heads"] if cfg.get("num_head_channels", -1) == -1 else None
    unet = UNet2DConditionModel(
        sample_size=cfg.get("image_size", 64), in_channels=cfg["in_channels"], out_channels=cfg["out_channels"],
        block_out_channels=tuple(cfg["model_channels"] * m for m in cfg["channel_mult"]),
        down_block_types=tuple("CrossAttnDownBlock2D" if a else "DownBlock2D" for a in with_attention),
        up_block_types=tuple("CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(with_attention)),
        mid_block_type="UNetMidBlock2DCrossAttn" if cfg.get("transformer_depth_middle", 1) >= 0 else None,
        layers_per_block=cfg["num_res_blocks"][0], cross_attention_dim=cfg["context_dim"],
        attention_head_dim=heads or cfg["num_head_channels"], use_linear_projection=cfg["use_linear_in_transformer"])
    ldm = base_model.diffusion_model.state_dict()
    names = comfy.utils.unet_to_diffusers(cfg)
    state = {dk: ldm[lk] for dk, lk in names.items() if lk in ldm}
    missing, unexpected = unet.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"diffusers UNet does not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return unet.eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapter", required=True)
    opts = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    import logging

    import torch
    import comfy.sd
    import comfy.utils
    from diffusers import StableDiffusionPipeline

    problems = []
    logging.getLogger().addHandler(type("Catch", (logging.Handler,), {
        "emit": lambda self, record: problems.append(record.getMessage())
        if "lora key not loaded" in record.getMessage() else None})())
    from ingraph_trainer.trainer.export import comfyui_readable, diffusers_module_names
    patcher = comfy.sd.load_diffusion_model(opts.model, model_options={"dtype": torch.float32})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    t = torch.tensor([100.0, 700.0])
    context = torch.randn(2, 77, patcher.model.model_config.unet_config["context_dim"], generator=g)
    unet = diffusers_unet(patcher.model)  # before ComfyUI patches the weights in place
    with torch.no_grad():
        base = unet(x, t, encoder_hidden_states=context).sample
    state, alphas = StableDiffusionPipeline.lora_state_dict(opts.adapter)
    StableDiffusionPipeline.load_lora_into_unet(state, alphas, unet=unet)
    lora = comfyui_readable(comfy.utils.load_torch_file(opts.adapter, safe_load=True),
                            diffusers_module_names(patcher.model))
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0.0)
    comfy.model_management.load_models_gpu([patched], force_full_load=True)
    with torch.no_grad():
        ours = patched.model.diffusion_model(x, t, context=context)
        theirs = unet(x, t, encoder_hidden_states=context).sample
    print(json.dumps({"max_abs_diff": (ours - theirs).abs().max().item(),
                      "adapter_effect": (theirs - base).abs().max().item(),
                      "comfyui_keys_not_loaded": len(problems)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
