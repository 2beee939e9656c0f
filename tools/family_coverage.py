"""Which of ComfyUI's own model classes this pack can build and train today (issue 34's coverage run, first part).

Walks the installed ComfyUI's `comfy.supported_models.models`. For each family file's tiny random-weight model (and
its variants: Wan's image-to-video ones, the embedded SD1.5), it asks ComfyUI's own detection which class that state
dict is (`model_detection.model_config_from_unet`), loads it with ComfyUI's loader, and asks the trainer which family
takes the loaded model; with --train, each such model also takes 2 LoRA training steps through the family's loss
(random latents and text of the family's shapes, the loss must be finite and the adapter's gradient non-zero).
Every class no builder here reaches is listed with what kind of model it is (its latent format), so the table says
what is covered and what is not yet.

    python tools/family_coverage.py [--train] [--markdown coverage.md] [--json coverage.json] [--readme README.md]
    COMFYUI_PATH=/opt/ComfyUI-0.33 PYTHONPATH=$PWD/.venv/comfyui-0.33 python tools/family_coverage.py

The last line is the count: classes in ComfyUI's list, image/video diffusion classes among them, and how many of
those a tiny model here is detected as (and trains, with --train). --readme rewrites that ComfyUI version's part of
the README's coverage section (between its `family-coverage` markers) from the same rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.prepare_run import _bootstrap  # noqa: E402

# builder label -> (family class name, scratch sizes) beyond each family's own "tiny" size
VARIANTS = {
    "wan i2v_2.1": ("WanFamily", dict(dim=128, ffn_dim=256, num_layers=1, variant="i2v_2.1")),
    "wan i2v_2.2": ("WanFamily", dict(dim=128, ffn_dim=256, num_layers=1, variant="i2v_2.2")),
    "wan ti2v_5b": ("WanFamily", dict(dim=128, ffn_dim=256, num_layers=1, variant="ti2v_5b")),
    "lumina2 z_image": ("Lumina2Family", dict(n_layers=1, variant="z_image")),  # ComfyUI 0.33's Z-Image
    "flux schnell": ("FluxFamily", dict(depth=1, depth_single_blocks=0, vec_in_dim=64, guidance_embed=False)),
    # SDXL's own classes are told apart by their transformer depths (ComfyUI's unet_config): each at width 320
    "sdxl (SDXL's depths)": ("SDXLFamily", dict(num_res_blocks=(2, 2, 2), transformer_depth=(0, 0, 2, 2, 10, 10))),
    "sdxl (SSD-1B's depths)": ("SDXLFamily", dict(num_res_blocks=(2, 2, 2), transformer_depth=(0, 0, 2, 2, 4, 4))),
    "sdxl (Vega's depths)": ("SDXLFamily", dict(num_res_blocks=(2, 2, 2), transformer_depth=(0, 0, 1, 1, 2, 2))),
    "sdxl (KOALA-1B's depths)": ("SDXLFamily", dict(transformer_depth=(0, 2, 6))),
}
TEXT_OF_BUILDER = {"lumina2 z_image": (8, 2560, None),  # Qwen3-4B's width
                   "sd_unet (tiny SD2)": (8, 1024, None)}  # OpenCLIP-H's
# text (tokens, width, pooled width or None) each family's tiny model takes in --train (its conditioning's shapes)
TEXT = {"sd_unet": (8, 768, None), "sdxl": (8, 2048, 1280), "sd3": (8, 64, 32), "flux": (8, 4096, 64),
        "wan": (8, 4096, None), "hunyuan_video": (8, 4096, 768), "ltxv": (8, 4096, None),
        "qwen_image": (8, 3584, None), "chroma": (8, 4096, None), "lumina2": (8, 2304, None),
        "flux2": (8, 64, None),  # the tiny Flux.2 reads 64-wide text (its txt_in; real ones: 7680 or 15360)
        "krea2": (8, 320, None),  # 2 encoder layers of 160 side by side (the real one: 12 of Qwen3-VL-4B)
        "hunyuan_video15": (8, 64, None)}


VIDEO_FAMILIES = ("wan", "hunyuan_video", "hunyuan_video15", "ltxv")
# classes the latent format misnames: an image model on a video VAE's latents, 3-D generators with image-like ones
KINDS = {"Krea2": "image", "Trellis2": "3D", "TripoSplat": "3D"}


def kind_of(config_class) -> str:
    """image, video, audio or 3D, from the class's latent format (ComfyUI's own description of its latents) and,
    for image models on a video VAE's latents (Qwen-Image, Cosmos text-to-image), its name."""
    if config_class.__name__ in KINDS:
        return KINDS[config_class.__name__]
    latent = getattr(config_class, "latent_format", None)
    name = f"{config_class.__name__} {getattr(latent, '__name__', '')}".lower()
    dims = getattr(latent, "latent_dimensions", 2)
    if getattr(latent, "__name__", "") == "LatentFormat":  # the base class: no latents of its own to denoise
        return "other"
    if "3d" in name:
        return "3D"
    if "audio" in name or "acestep" in name or dims == 1:
        return "audio"
    if dims == 3 and not any(w in config_class.__name__ for w in ("Image", "T2I")):
        return "video"
    return "image"


def builders() -> list:
    """(label, a function building its state dict) of every tiny model this pack builds: each family file's, its
    variants, SD1.5's (the embedded default checkpoint)."""
    from ingraph_trainer.trainer.models import FAMILIES
    from ingraph_trainer.trainer.models.base import ModelFamily

    def sd15():
        from safetensors.torch import load_file
        from tools.embedded_default import build_checkpoint
        with tempfile.TemporaryDirectory() as tmp:
            path = build_checkpoint(Path(tmp) / "sd15.safetensors")
            prefix = "model.diffusion_model."
            return {k[len(prefix):]: v for k, v in load_file(str(path)).items() if k.startswith(prefix)}
    def sd2():  # the embedded default's UNet with SD2's text width and linear projections: ComfyUI's SD20
        import comfy.ops
        from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
        from ingraph_trainer.trainer.models.base import init_weights
        from tools.embedded_default import TINY_UNET_CONFIG
        unet = UNetModel(**{**TINY_UNET_CONFIG, "context_dim": 1024, "use_linear_in_transformer": True},
                         operations=comfy.ops.disable_weight_init)
        return {k: v.contiguous() for k, v in init_weights(unet, 0).state_dict().items()}
    out = [("sd_unet (embedded SD1.5)", sd15), ("sd_unet (tiny SD2)", sd2)]
    for cls in FAMILIES:
        if cls.scratch_state_dict.__func__ is ModelFamily.scratch_state_dict.__func__:  # builds none (SD1.5: above)
            continue
        out.append((cls.name, lambda cls=cls: cls.scratch_state_dict(0, **cls.scratch_sizes.get("tiny", {}))))
    by_name = {c.__name__: c for c in FAMILIES}
    for label, (cls_name, size) in VARIANTS.items():
        out.append((label, lambda c=by_name[cls_name], size=size: c.scratch_state_dict(0, **size)))
    return out


def train_two_steps(family, builder: str) -> str:
    """2 LoRA steps on random inputs of the family's shapes: "yes", or why not."""
    import torch
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.models import Batch
    tokens, width, pooled = TEXT_OF_BUILDER.get(builder) or TEXT.get(family.name, (8, 4096, None))
    channels = family.base_model.latent_format.latent_channels
    # video families on 3 latent frames; everything else on image latents (the family lays them out as its model
    # takes them: Qwen-Image's one-frame videos, say)
    shape = (2, channels, 3, 4, 8) if family.name in VIDEO_FAMILIES else (2, channels, 8, 8)
    family.prepare_for_training()  # as the trainer does (residuals out of place, ...)
    params = inject_adapter(family.diffusion_model, family.adapter_targets("attention"), "lora", 2, 2.0, 0.0)
    family.compute_dtype = torch.float32
    family.diffusion_model.float()
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        batch = Batch(torch.randn(shape, generator=g), torch.randn(2, tokens, width, generator=g),
                      torch.randn(2, pooled, generator=g) if pooled else None, torch.randn(shape, generator=g),
                      torch.rand(2, generator=g))
        loss = family.loss(batch)
        loss.backward()
        if not torch.isfinite(loss):
            return f"no: loss {float(loss)}"
        if not any(p.grad is not None and p.grad.abs().sum() > 0 for p in params):
            return "no: the adapter took no gradient"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return "yes"


README_BEGIN = "<!-- family-coverage: ComfyUI {version} (written by tools/family_coverage.py --train --readme) -->"
README_END = "<!-- end family-coverage: ComfyUI {version} -->"


def readme_section(version: str, summary: str, rows: list[dict], full_table: str) -> str:
    """The README's part for one ComfyUI: the count, the classes trained (with the family that trains each), and
    what is left, by kind, pointing at the full table."""
    trained = [r for r in rows if "yes" in r["trained"]]
    left = [r for r in rows if r["kind"] in ("image", "video") and "yes" not in r["trained"]]
    lines = [README_BEGIN.format(version=version), f"**{summary}**", "",
             "| ComfyUI class | kind | family | tiny model here |", "|---|---|---|---|"]
    lines += [f"| {r['class']} | {r['kind']} | {', '.join(r['family'])} | {', '.join(r['builders'])} |"
              for r in sorted(trained, key=lambda r: (r["kind"], r["class"]))]
    lines += ["", f"Not yet ({len(left)} image or video classes): " + ", ".join(r["class"] for r in left)
              + f". Every class, audio, 3-D and other models included: [{full_table}]({full_table}).",
              README_END.format(version=version)]
    return "\n".join(lines)


def replace_readme_section(readme: Path, version: str, section: str) -> None:
    """Puts `section` between this version's markers in the README (refused where the markers are missing)."""
    text = readme.read_text(encoding="utf-8")
    begin, end = README_BEGIN.format(version=version), README_END.format(version=version)
    if begin not in text or end not in text:
        raise SystemExit(f"{readme}: no family-coverage markers for ComfyUI {version}; add\n{begin}\n{end}")
    head, rest = text.split(begin, 1)
    readme.write_text(head + section + rest.split(end, 1)[1], encoding="utf-8")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", action="store_true", help="2 LoRA steps on each model detected")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--readme", type=Path, help="rewrite this ComfyUI version's coverage section of this README "
                                                    "(with --markdown: the full table it links to)")
    opts = parser.parse_args(argv)
    _bootstrap()
    import comfy.model_detection
    import comfy.sd
    import comfy.supported_models
    import torch
    from ingraph_trainer.trainer.comfy_compat import comfyui_version
    from ingraph_trainer.trainer.models import family_for
    from tools.comfy_server import comfyui_path
    version = ".".join(map(str, comfyui_version(comfyui_path()))) or "?"
    classes = list(comfy.supported_models.models)
    reached = {}  # class name -> list of (builder, family, trained)
    for label, build in builders():
        began = time.perf_counter()
        try:
            torch.manual_seed(0)
            state = build()
        except Exception as exc:  # noqa: BLE001 - a variant this ComfyUI's model classes cannot build
            print(f"{label}: not built on this ComfyUI ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
            continue
        config = comfy.model_detection.model_config_from_unet(state, "")
        if config is None:
            print(f"{label}: ComfyUI detects no class", flush=True)
            continue
        patcher = comfy.sd.load_diffusion_model_state_dict(state, model_options={"dtype": torch.float32})
        family = family_for(patcher.model, patcher=patcher)
        try:
            trained = train_two_steps(family, label) if opts.train else "not tried"
        except Exception as exc:  # noqa: BLE001 - the table says why, the walk goes on
            trained = f"no: {type(exc).__name__}: {str(exc)[:120]}"
        name = type(config).__name__
        reached.setdefault(name, []).append({"builder": label, "family": family.name, "trained": trained})
        print(f"{label}: detected as {name}, family {family.name}, trained {trained} "
              f"({time.perf_counter() - began:.1f} s)", flush=True)
        del patcher, family, state
    rows = []
    for cls in classes:
        hits = reached.get(cls.__name__, [])
        rows.append({"class": cls.__name__, "kind": kind_of(cls),
                     "latent_format": getattr(getattr(cls, "latent_format", None), "__name__", "?"),
                     "builders": [h["builder"] for h in hits], "family": sorted({h["family"] for h in hits}),
                     "trained": [h["trained"] for h in hits]})
    diffusion = [r for r in rows if r["kind"] in ("image", "video")]  # audio, 3D and other: out of this pack's scope
    covered = [r for r in diffusion if r["builders"]]
    trained = [r for r in covered if "yes" in r["trained"]]
    lines = [f"ComfyUI {version}: {len(rows)} model classes; {len(diffusion)} image or video diffusion classes, "
             f"{len(covered)} of them built here as a tiny model ComfyUI detects as that class"
             + (f", {len(trained)} trained 2 steps" if opts.train else "") + ".", "",
             "| ComfyUI class | kind | latent format | tiny model here | family | 2 LoRA steps |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["kind"] not in ("image", "video"), not r["builders"], r["class"])):
        lines.append(f"| {r['class']} | {r['kind']} | {r['latent_format']} | {', '.join(r['builders']) or 'not yet'} "
                     f"| {', '.join(r['family']) or ''} | {', '.join(sorted(set(r['trained']))) or ''} |")
    table = "\n".join(lines)
    if opts.markdown:
        opts.markdown.write_text(table + "\n")
    if opts.json:
        opts.json.write_text(json.dumps({"comfyui": version, "rows": rows}, indent=1))
    if opts.readme:
        if not (opts.train and opts.markdown):
            raise SystemExit("--readme needs --train and --markdown (the section says what trains, and links the table)")
        link = opts.markdown.resolve().relative_to(opts.readme.resolve().parent).as_posix()
        replace_readme_section(opts.readme, version, readme_section(version, lines[0], rows, link))
    print(table)
    print(lines[0])


if __name__ == "__main__":
    main()
