"""What the family test modules share (tests/comfyui/test_model_families.py, test_image_families.py, test_video_families.py,
test_flux_graph_unchanged.py, test_starting_graphs.py): the tiny models each needs in the server and the fixtures
that put them there, the stock training and sampling graphs, and reading their results. No test lives here."""
from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import IMAGE_FOLDER, ON_COMFYUI_033, REPO, SUITE_EVAL_QUANTILES, tiny_models


def bootstrap_comfy():
    sys.path.insert(0, str(REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()


# two of the example images: few forward passes a run (evaluation at one quantile: training_graph's eval_quantiles)
FAMILY_FOLDER = "ingraph_family"

# family → (VAE file, dtype the tiny model is stored in); Flux cannot be made small (see tools/tiny_models.py); Wan
# takes a video VAE's latents (an image VAE's are refused), the tiny Wan 2.1 VAE's
FAMILIES = {"sdxl": ("tiny_taesd4.safetensors", "fp32"), "sd3": ("tiny_taesd16.safetensors", "fp32"),
            "flux": ("tiny_taesd16.safetensors", "bf16"), "wan": ("tiny_wan_vae.safetensors", "fp32")}
FAMILY_TINY_MODELS = dict(families={family: dtype for family, (_, dtype) in FAMILIES.items()},
                          vae16="tiny_taesd16.safetensors", vae4="tiny_taesd4.safetensors",
                          wan_vae="tiny_wan_vae.safetensors")  # conftest.tiny_models


@pytest.fixture(scope="module")
def family_models(comfy, tools):
    """Tiny models of every family in the server's models/diffusion_models, VAEs in models/vae (conftest.tiny_models:
    built once a session, in the background from its start)."""
    images = comfy.dir("input", FAMILY_FOLDER)
    for source in sorted(comfy.dir("input", IMAGE_FOLDER).iterdir())[:4]:  # two images and their captions
        (images / source.name).write_bytes(source.read_bytes())
    tiny_models(tools, comfy, **FAMILY_TINY_MODELS)
    return comfy


def training_graph(family: str, output_name: str, model: dict | None = None, text_family: str | None = None,
                   **train) -> dict:
    vae_file = FAMILIES[family][0]
    return {
        "1": model or {"class_type": "UNETLoader", "inputs": {"unet_name": f"tiny_{family}.safetensors",
                                                              "weight_dtype": "default"}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": vae_file}},
        "3": {"class_type": "InGraphTestSyntheticTextEncoder", "inputs": {"family": text_family or family}},
        "4": {"class_type": "InGraphLoadTrainingImages",
              "inputs": {"folder": FAMILY_FOLDER, "resolution": 64, "bucketing": False, "min_side": 64,
                         "max_side": 256, "max_upscale": 1.0, "crop": "center", "flip": False, "repeats": 1,
                         "caption_prefix": "", "missing_caption": "error", "default_caption": ""}},
        "5": {"class_type": "InGraphCacheLatents", "inputs": {"dataset": ["4", 0], "vae": ["2", 0]}},
        "6": {"class_type": "InGraphCacheTextEmbeddings", "inputs": {"dataset": ["5", 0], "clip": ["3", 0]}},
        "7": {"class_type": "InGraphLoRAAdapter",
              "inputs": {"kind": train.pop("kind", "LoRA"), "rank": 4, "alpha": 4.0, "dropout": 0.0,
                         "targets": "attention"}},
        "8": {"class_type": "InGraphTrainLoRA",
              "inputs": {"model": ["1", 0], "dataset": ["6", 0], "adapter": ["7", 0], "steps": 2, "batch_size": 2,
                         "gradient_accumulation": 1, "learning_rate": 1e-3, "optimizer": "AdamW",
                         "lr_schedule": "constant", "warmup_steps": 0, "precision": "fp32",
                         "gradient_checkpointing": False, "seed": 0, "save_every": 0, "output_name": output_name,
                         "resume": "off", "eval_quantiles": SUITE_EVAL_QUANTILES, **train}},
    }


def sampling_graph(family: str, lora_name: str | None, prefix: str, unet_name: str | None = None,
                   text_family: str | None = None) -> dict:
    """Stock nodes only: UNETLoader (+ LoraLoaderModelOnly) → KSampler on an empty 64x64 latent → SaveLatent.
    The model file is tiny_<family>.safetensors and the synthetic text encoder the family's, unless named."""
    graph = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name or f"tiny_{family}.safetensors",
                                                     "weight_dtype": "default"}},
        "3": {"class_type": "InGraphTestSyntheticTextEncoder", "inputs": {"family": text_family or family}},
        "10": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle, ingraph style", "clip": ["3", 0]}},
        "11": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["3", 0]}},
        "12": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "13": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["10", 0], "negative": ["11", 0],
                                                    "latent_image": ["12", 0], "seed": 1, "steps": 2, "cfg": 2.0,
                                                    "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "14": {"class_type": "SaveLatent", "inputs": {"samples": ["13", 0], "filename_prefix": f"latents/{prefix}"}},
    }
    if lora_name:
        graph["9"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora_name,
                                                                      "strength_model": 1.0}}
        graph["13"]["inputs"]["model"] = ["9", 0]
    return graph


def saved_latent(comfy, prefix: str) -> torch.Tensor:
    files = sorted((comfy.base_dir / "output" / "latents").glob(f"{prefix}_*.latent"))
    assert files, f"no latent saved for {prefix}"
    return load_file(str(files[-1]))["latent_tensor"]


def run_events(outcome) -> list[dict]:
    return [m["data"]["event"] for m in outcome.messages if m.get("type") == "ingraph.event"]


# family → (latent of one item as cached: C, h, w; text tokens and width the tiny model takes)
IMAGE_FAMILIES = {"qwen_image": ((16, 6, 10), (8, 3584)), "chroma": ((16, 6, 10), (8, 4096)),
                  "lumina2": ((16, 6, 10), (8, 2304))}
IMAGE_TINY_MODELS = dict(families={**{family: "bf16" for family in IMAGE_FAMILIES}, "flux": "bf16"},
                   vae16="tiny_taesd16.safetensors", wan_vae="tiny_wan_vae.safetensors")  # conftest.tiny_models


EDIT_FOLDER = "ingraph_edit"  # one family image with a name.ref.png (its mirror image) as edit source
EDIT_REFERENCE = "ingraph_edit_reference.png"  # the source image the stock edit graph loads (LoadImage)
# one image, batch 1, in every chain (suite time): every forward pass costs (evaluation before and after, at one
# quantile: training_graph's eval_quantiles)
SINGLE_FOLDER = "ingraph_single"


@pytest.fixture(scope="module")
def image_family_models(comfy, tools):
    """Tiny Qwen-Image, Chroma and Lumina 2 models in the server's diffusion_models folder (bf16), and what the
    graph test needs beside them: the tiny Flux, the 16-channel TAESD, the tiny Wan VAE (conftest.tiny_models: each
    built once a session, in the background from its start); one image alone, and with a reference image."""
    from PIL import Image, ImageOps
    edit = comfy.dir("input", EDIT_FOLDER)
    for source in sorted(comfy.dir("input", IMAGE_FOLDER).iterdir())[:2]:  # the first image and its caption
        for folder in (edit, comfy.dir("input", SINGLE_FOLDER)):
            (folder / source.name).write_bytes(source.read_bytes())
        if source.suffix != ".txt":
            mirrored = ImageOps.mirror(Image.open(source).convert("RGB"))
            mirrored.save(edit / f"{source.stem}.ref.png")
            mirrored.save(comfy.dir("input") / EDIT_REFERENCE)
    tiny_models(tools, comfy, **IMAGE_TINY_MODELS)
    return comfy


WAN_TINY = dict(dim=128, ffn_dim=256, num_layers=1)
# file stem → (family class name, scratch size, ComfyUI's supported_models class, family, variant, latent channels,
#              synthetic text family, VAE latent channels)
VIDEO_MODELS = {
    "tiny_wan21_t2v": ("WanFamily", dict(WAN_TINY), "WAN21_T2V", "wan", "t2v", 16, "wan"),
    "tiny_wan21_i2v": ("WanFamily", dict(WAN_TINY, variant="i2v_2.1"), "WAN21_I2V", "wan", "i2v_2.1", 16, "wan"),
    "tiny_wan22_i2v": ("WanFamily", dict(WAN_TINY, variant="i2v_2.2"), "WAN21_T2V", "wan", "i2v_2.2", 16, "wan"),
    "tiny_wan22_ti2v": ("WanFamily", dict(WAN_TINY, variant="ti2v_5b"), "WAN22_T2V", "wan", "ti2v_5b", 48, "wan"),
    "tiny_hunyuan_video": ("HunyuanVideoFamily", {}, "HunyuanVideo", "hunyuan_video", None, 16, "hunyuan_video"),
    "tiny_ltxv": ("LTXVFamily", {}, "LTXV", "ltxv", None, 128, "ltxv"),
}
if ON_COMFYUI_033:  # LTX-2, sized by its file's metadata: built as tools/family_coverage.py builds it
    VIDEO_MODELS["tiny_ltxav"] = ("LTXAV", {}, "LTXAV", "ltxav", None, 128, "ltxav")


def write_video_models(folder) -> dict:
    """The tiny models as files, written with safetensors as a user's download would be."""
    bootstrap_comfy()
    from safetensors.torch import save_file

    from ingraph_trainer.trainer import models
    from tools.family_coverage import CLASS_BUILT, class_state_dict
    paths = {}
    for stem, (cls_name, size, *_) in VIDEO_MODELS.items():
        metadata = None
        if cls_name in CLASS_BUILT:  # a ComfyUI class no family file builds
            built = class_state_dict(cls_name, *CLASS_BUILT[cls_name])
            state, metadata = built if isinstance(built, tuple) else (built, None)
        else:
            cls = getattr(models, cls_name)
            state = cls.scratch_state_dict(0, **{**cls.scratch_sizes.get("tiny", {}), **size})
        paths[stem] = folder / f"{stem}.safetensors"
        save_file(state, str(paths[stem]), metadata=metadata)
    return paths


@pytest.fixture(scope="module")
def video_model_files(tmp_path_factory):
    return write_video_models(tmp_path_factory.mktemp("video_models"))


REFERENCE_FOLDER = "ingraph_family_start"  # the family images, each with a start image (name.ref.png) beside it
# latent width -> an image VAE (a TAESD) VAELoader loads by that name, for the image models
VAE_CHANNELS = {16: "tiny_taesd16.safetensors", 128: "tiny_taesd128.safetensors"}
if ON_COMFYUI_033:  # its 128-channel TAESD is Flux.2's (32 channels, 2x2 packed), which VAELoader knows by name only
    VAE_CHANNELS[128] = "taef2"
# latent width -> a video VAE for the video models, whose latents are [C, T, H, W] (an image VAE's are refused):
# ComfyUI 0.33's TAEHV (taew2_1, taew2_2, taeltx_2), 8x in space for 16 channels, 16x for 48, 32x for 128; 0.3.64
# has none this small (the video-model graph tests that use them run on 0.33)
VIDEO_VAE_CHANNELS = {16: "tiny_taehv16.safetensors", 48: "tiny_taehv48.safetensors",
                      128: "tiny_taehv128.safetensors"}


def write_tiny_vaes(comfy, names: dict[int, str]) -> None:
    """A random-weight VAE of each latent width in `names` (width -> VAELoader's name: VAE_CHANNELS' TAESDs,
    VIDEO_VAE_CHANNELS' TAEHVs) in the server's models folders."""
    bootstrap_comfy()
    from comfy.taesd.taesd import TAESD

    from ingraph_trainer.trainer.models.base import init_weights
    from tools.tiny_models import _save
    for channels, name in names.items():
        if name in VIDEO_VAE_CHANNELS.values():
            from comfy.taesd.taehv import TAEHV  # (0.33 and later)
            _save(init_weights(TAEHV(latent_channels=channels), 2).state_dict(), comfy.dir("models", "vae") / name)
            continue
        taesd = init_weights(TAESD(latent_channels=channels), 2)
        if name == "taef2":  # VAELoader's image TAE: an encoder and a decoder file in vae_approx
            for part in ("encoder", "decoder"):
                _save({k.removeprefix(f"taesd_{part}."): v for k, v in taesd.state_dict().items()
                       if k.startswith(f"taesd_{part}.")},
                      comfy.dir("models", "vae_approx") / f"taef2_{part}.safetensors")
            continue
        _save({k: v for k, v in taesd.state_dict().items() if k.startswith(("taesd_encoder.", "taesd_decoder."))},
              comfy.dir("models", "vae") / name)


@pytest.fixture(scope="module")
def video_models_in_server(comfy, video_model_files):
    """The tiny video models in the server's diffusion-models folder, a TAESD for each latent width in models/vae,
    the two family images plain and with start images beside them."""
    import shutil

    from PIL import Image
    unets = comfy.dir("models", "diffusion_models")
    for path in video_model_files.values():
        shutil.copy(path, unets / path.name)
    write_tiny_vaes(comfy, VAE_CHANNELS)
    if ON_COMFYUI_033:
        write_tiny_vaes(comfy, VIDEO_VAE_CHANNELS)
    plain, with_start = comfy.dir("input", FAMILY_FOLDER), comfy.dir("input", REFERENCE_FOLDER)
    for source in sorted(comfy.dir("input", IMAGE_FOLDER).iterdir())[:4]:  # two images and their captions
        (plain / source.name).write_bytes(source.read_bytes())
        (with_start / source.name).write_bytes(source.read_bytes())
        if source.suffix == ".png":  # the start image: the same picture mirrored
            Image.open(source).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(with_start / f"{source.stem}.ref.png")
    return comfy


def merged(graphs: dict[str, dict]) -> dict:
    """One prompt from several graphs: each graph's node ids prefixed with its name, links rewritten."""
    prompt = {}
    for prefix, graph in graphs.items():
        for node_id, node in graph.items():
            inputs = {k: [f"{prefix}.{v[0]}", v[1]] if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                      else v for k, v in node["inputs"].items()}
            prompt[f"{prefix}.{node_id}"] = {**node, "inputs": inputs}
    return prompt
