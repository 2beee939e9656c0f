"""The starting graphs for real models (issue 32): one LoRA graph per family people train most, with the stock
loaders of that family and settings that work on a 24 GB card, written in API form to workflows/api/ (and, with a
running server, in UI form to example_workflows/ with a thumbnail each).

    python tools/starting_graphs.py                      # the API files
    python tools/starting_graphs.py --server HOST:PORT   # and the UI graphs and thumbnails (the server's /object_info)

Each recipe says what it loads (the file names ComfyUI's own templates and the model pages use) and why its
settings are what they are, and the ComfyUI it needs (`comfyui`, where 0.3.64 does not load its files: Flux.2,
Z-Image and LTX-2 are tested on 0.33). tests/comfyui/test_starting_graphs.py checks every widget value against /object_info and runs
each graph through the API with the family's tiny model in place of the real one.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _checkpoint(name: str) -> dict:
    return {"model": {"class_type": "CheckpointLoaderSimple", "_meta": {"title": "Load Checkpoint"},
                      "inputs": {"ckpt_name": name}}}


def _diffusion_model(unet: str, weight_dtype: str, text: dict, vae: str) -> dict:
    return {"model": {"class_type": "UNETLoader", "_meta": {"title": "Load Diffusion Model"},
                      "inputs": {"unet_name": unet, "weight_dtype": weight_dtype}},
            "text_encoder": text,
            "vae": {"class_type": "VAELoader", "_meta": {"title": "Load VAE"}, "inputs": {"vae_name": vae}}}


# name → loaders, dataset, adapter, training and preview settings. Rank 16 at alpha 16 and a learning rate of 1e-4
# with AdamW are what kohya, ai-toolkit and musubi-tuner start LoRAs of these families at; the resolution is the
# model's own (SD1.5 512, SDXL, Flux and Qwen-Image 1024, Wan 2.2 5B trained lower, at 512, to fit clips).
RECIPES = {
    "start_sd15_lora": dict(
        loaders=_checkpoint("v1-5-pruned-emaonly-fp16.safetensors"),
        dataset=dict(folder="training_images", resolution=512),
        adapter=dict(rank=16, alpha=16.0, targets="attention + feed-forward"),
        train=dict(steps=1500, batch_size=2, learning_rate=1e-4, gradient_checkpointing=False, save_every=250,
                   output_name="my_sd15_lora"),
        previews=dict(prompts="a photo of my subject", cfg=7.0, steps=20, width=512, height=512, every=250)),
    "start_sdxl_lora": dict(
        loaders=_checkpoint("sd_xl_base_1.0.safetensors"),
        dataset=dict(folder="training_images", resolution=1024),
        adapter=dict(rank=16, alpha=16.0, targets="attention + feed-forward"),
        # batch 1 with checkpointing: SDXL at 1024² fits 12-16 GB cards this way
        train=dict(steps=2000, batch_size=1, gradient_accumulation=2, learning_rate=1e-4,
                   gradient_checkpointing=True, save_every=250, output_name="my_sdxl_lora"),
        previews=dict(prompts="a photo of my subject", cfg=7.0, steps=25, width=1024, height=1024, every=250)),
    "start_flux_dev_lora_fp8": dict(
        # Flux dev (12B) held in fp8 (12 GB) with checkpointing fits a 24 GB card; the LoRA trains in full precision
        loaders=_diffusion_model(
            "flux1-dev.safetensors", "fp8_e4m3fn",
            {"class_type": "DualCLIPLoader", "_meta": {"title": "Load CLIP-L and T5"},
             "inputs": {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp8_e4m3fn.safetensors",
                        "type": "flux"}},
            "ae.safetensors"),
        dataset=dict(folder="training_images", resolution=1024),
        adapter=dict(rank=16, alpha=16.0, targets="attention + feed-forward"),
        # guidance 1: Flux dev is guidance-distilled, and LoRAs train at 1 (as ai-toolkit does)
        train=dict(steps=1500, batch_size=1, learning_rate=1e-4, gradient_checkpointing=True, save_every=250,
                   guidance=1.0, output_name="my_flux_lora"),
        previews=dict(prompts="a photo of my subject", cfg=1.0, steps=20, width=1024, height=1024, every=250,
                      scheduler="simple")),
    "start_wan22_5b_video_lora": dict(
        # Wan 2.2 TI2V 5B: the video model that trains on one 24 GB card in bf16 (the 14B ones need block swap)
        loaders=_diffusion_model(
            "wan2.2_ti2v_5B_fp16.safetensors", "default",
            {"class_type": "CLIPLoader", "_meta": {"title": "Load umT5"},
             "inputs": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan"}},
            "wan2.2_vae.safetensors"),
        # clips (mp4, webm ...) with name.txt captions: 33 frames (4k+1, what Wan's VAE takes) at the model's 24 fps
        dataset=dict(folder="training_clips", resolution=512, frame_buckets="1, 17, 33", fps=24.0),
        adapter=dict(rank=16, alpha=16.0, targets="attention + feed-forward"),
        train=dict(steps=1000, batch_size=1, learning_rate=1e-4, gradient_checkpointing=True, save_every=200,
                   output_name="my_wan22_lora"),
        previews=dict(prompts="my subject walking through a forest", cfg=5.0, steps=20, width=512, height=512,
                      every=200, sampler_name="uni_pc", scheduler="simple")),
    "start_qwen_image_edit_lora": dict(
        # Qwen-Image-Edit (20B) in fp8 (20 GB): needs a 24 GB card with checkpointing, or block swap below that.
        # Each training image (the edit's result) has its source image beside it as name.ref.png
        loaders=_diffusion_model(
            "qwen_image_edit_2509_fp8_e4m3fn.safetensors", "default",
            {"class_type": "CLIPLoader", "_meta": {"title": "Load Qwen2.5-VL"},
             "inputs": {"clip_name": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "type": "qwen_image"}},
            "qwen_image_vae.safetensors"),
        dataset=dict(folder="edit_pairs", resolution=768),
        adapter=dict(rank=16, alpha=16.0, targets="attention + feed-forward"),
        train=dict(steps=1500, batch_size=1, learning_rate=1e-4, gradient_checkpointing=True, save_every=250,
                   output_name="my_qwen_edit_lora"),
        previews=dict(prompts="make the sky pink", cfg=2.5, steps=20, width=768, height=768, every=250,
                      scheduler="simple")),
    # ComfyUI 0.33 (the diffusion models, text encoders and their CLIPLoader types are those of ComfyUI's own
    # blueprints; the VAEs are the full ones, for encoding the training images)
    "start_flux2_dev_lora": dict(
        # Flux.2 dev (32B) as ComfyUI ships it, fp8 with scales (about 35 GB): the LoRA trains on the quantized
        # weights as they are. No single consumer card holds it: memory "auto" swaps blocks to host RAM on a 24-48
        # GB card, and says before the run what stays on the GPU. The text encoder in fp8 (24 GB; the blueprint's
        # bf16 file is 48 GB), since ComfyUI keeps it in host RAM beside the model's copies
        loaders=_diffusion_model(
            "flux2_dev_fp8mixed.safetensors", "default",
            {"class_type": "CLIPLoader", "_meta": {"title": "Load Mistral 3 Small"},
             "inputs": {"clip_name": "mistral_3_small_flux2_fp8.safetensors", "type": "flux2"}},
            "flux2-vae.safetensors"),
        dataset=dict(folder="training_images", resolution=1024),
        adapter=dict(rank=16, alpha=16.0, targets="attention + feed-forward"),
        # guidance 1, as for Flux dev: Flux.2 dev is guidance-distilled (its blueprint samples at FluxGuidance 4)
        train=dict(steps=1500, batch_size=1, learning_rate=1e-4, gradient_checkpointing=True, save_every=250,
                   guidance=1.0, output_name="my_flux2_lora"),
        previews=dict(prompts="a photo of my subject", cfg=1.0, steps=20, width=1024, height=1024, every=250,
                      scheduler="simple"),
        comfyui="0.33"),
    "start_z_image_lora": dict(
        # Z-Image (6B, the base model, not the distilled Turbo) in bf16 (12 GB) with checkpointing fits a 24 GB card
        loaders=_diffusion_model(
            "z_image_bf16.safetensors", "default",
            {"class_type": "CLIPLoader", "_meta": {"title": "Load Qwen3 4B"},
             "inputs": {"clip_name": "qwen_3_4b.safetensors", "type": "lumina2"}},
            "ae.safetensors"),
        dataset=dict(folder="training_images", resolution=1024),
        adapter=dict(rank=16, alpha=16.0, targets="attention + feed-forward"),
        train=dict(steps=1500, batch_size=1, learning_rate=1e-4, gradient_checkpointing=True, save_every=250,
                   output_name="my_z_image_lora"),
        # the base model's blueprint: 25 steps of res_multistep at cfg 4
        previews=dict(prompts="a photo of my subject", cfg=4.0, steps=25, width=1024, height=1024, every=250,
                      sampler_name="res_multistep", scheduler="simple"),
        comfyui="0.33"),
    "start_ltx2_video_lora": dict(
        # LTX-2.3 (22B) dev as its blueprint loads it: one fp8 checkpoint (about 27 GB) holding the model and its
        # video VAE, and Gemma 3 12B through LTX's own text-encoder loader. It trains on video alone (the audio
        # stream is left out: no audio latents are cached), on the fp8 weights as they are; memory "auto" swaps
        # blocks to host RAM where a 24-32 GB card does not hold it, and says so before the run
        loaders={"model": _checkpoint("ltx-2.3-22b-dev-fp8.safetensors")["model"],
                 "text_encoder": {"class_type": "LTXAVTextEncoderLoader", "_meta": {"title": "Load Gemma 3 (LTX)"},
                                  "inputs": {"text_encoder": "gemma_3_12B_it_fp4_mixed.safetensors",
                                             "ckpt_name": "ltx-2.3-22b-dev-fp8.safetensors", "device": "default"}}},
        # clips with name.txt captions: 8k+1 frames (what LTX's VAE takes: 1 latent frame per 8) at 24 fps
        dataset=dict(folder="training_clips", resolution=512, frame_buckets="1, 25, 49", fps=24.0),
        adapter=dict(rank=16, alpha=16.0, targets="attention + feed-forward"),
        train=dict(steps=1000, batch_size=1, learning_rate=1e-4, gradient_checkpointing=True, save_every=200,
                   output_name="my_ltx2_lora"),
        previews=dict(prompts="my subject walking through a forest", cfg=4.0, steps=30, width=768, height=512,
                      every=200, scheduler="simple"),
        comfyui="0.33"),
}


def needs_comfyui(recipe: dict) -> tuple[int, ...]:
    """The ComfyUI the recipe is tested on (its `comfyui`; 0.3.64 where it names none): older ones may lack its
    loaders' types."""
    return tuple(int(part) for part in recipe.get("comfyui", "0.3.64").split("."))


def api_graph(recipe: dict) -> dict:
    """The recipe as an API-format graph: loaders → Load Training Images → Cache Latents → Cache Text Embeddings
    → Train LoRA (with LoRA Adapter and Sample Previews) → the loss chart."""
    loaders = recipe["loaders"]
    graph = {"1": loaders["model"]}
    model, clip, vae = ["1", 0], ["1", 1], ["1", 2]  # a checkpoint's, unless loaded on their own
    if "text_encoder" in loaders:
        graph["2"], clip = loaders["text_encoder"], ["2", 0]
    if "vae" in loaders:
        graph["3"], vae = loaders["vae"], ["3", 0]
    graph["4"] = {"class_type": "InGraphLoadTrainingImages", "_meta": {"title": "Load Training Images"},
                  "inputs": {"bucketing": True, "min_side": 256, "max_side": 2048, "max_upscale": 1.0,
                             "crop": "center", "flip": False, "repeats": 1, "caption_prefix": "",
                             "missing_caption": "error", "default_caption": "", **recipe["dataset"]}}
    graph["5"] = {"class_type": "InGraphCacheLatents", "_meta": {"title": "Cache Latents"},
                  "inputs": {"dataset": ["4", 0], "vae": vae}}
    graph["6"] = {"class_type": "InGraphCacheTextEmbeddings", "_meta": {"title": "Cache Text Embeddings"},
                  "inputs": {"dataset": ["5", 0], "clip": clip}}
    graph["7"] = {"class_type": "InGraphLoRAAdapter", "_meta": {"title": "LoRA Adapter"},
                  "inputs": {"kind": "LoRA", "dropout": 0.0, **recipe["adapter"]}}
    graph["8"] = {"class_type": "InGraphSamplePreviews", "_meta": {"title": "Sample Previews"},
                  "inputs": {"clip": clip, "vae": vae, "negative_prompt": "", "sampler_name": "euler",
                             "scheduler": "normal", "seed": 0, **recipe["previews"]}}
    graph["9"] = {"class_type": "InGraphTrainLoRA", "_meta": {"title": "Train LoRA"},
                  "inputs": {"model": model, "dataset": ["6", 0], "adapter": ["7", 0], "previews": ["8", 0],
                             "gradient_accumulation": 1, "optimizer": "AdamW", "lr_schedule": "constant",
                             "warmup_steps": 0, "precision": "bf16", "seed": 0, "resume": "off",
                             **recipe["train"]}}
    graph["10"] = {"class_type": "PreviewImage", "_meta": {"title": "Loss chart"}, "inputs": {"images": ["9", 2]}}
    return graph


def write_api(folder: Path = REPO / "workflows" / "api") -> list[Path]:
    paths = []
    for name, recipe in RECIPES.items():
        path = folder / f"{name}_api.json"
        path.write_text(json.dumps(api_graph(recipe), indent=1) + "\n")
        paths.append(path)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="a running ComfyUI with the pack: also write the UI graphs and thumbnails")
    opts = parser.parse_args(argv)
    for path in write_api():
        print(path)
        if opts.server:
            ui = REPO / "example_workflows" / f"{path.name.removesuffix('_api.json')}.json"
            subprocess.run([sys.executable, str(REPO / "tools" / "make_ui_workflow.py"), str(path), str(ui),
                            "--server", opts.server], check=True)
            subprocess.run([sys.executable, str(REPO / "tools" / "make_thumbnails.py"), str(ui)], check=True)


if __name__ == "__main__":
    main()
