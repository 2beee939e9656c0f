"""The Compare node's grid: the same prompts and seeds through two MODELs with ComfyUI's stock sampling."""
from __future__ import annotations

import textwrap


def parse_seeds(text: str) -> list[int]:
    seeds = []
    for part in text.replace(",", " ").split():
        try:
            seeds.append(int(part))
        except ValueError:
            raise ValueError(f"seeds: {part!r} is not a whole number") from None
    if not seeds:
        raise ValueError("seeds: give at least one seed, e.g. 0, 1")
    return seeds


def parse_prompts(text: str, what: str = "prompts") -> list[str]:
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{what}: give at least one prompt (one per line)")
    return prompts


def sample_image(model, positive, negative, seed: int, *, vae, **settings):
    """One image (H, W, 3 in [0, 1]) the way KSampler + VAE Decode make it (settings: see sample_latent)."""
    from ..trainer.sampling import sample_latent
    images = vae.decode(sample_latent(model, positive, negative, seed, **settings))
    return images.reshape(-1, *images.shape[-3:])[0]


def labelled_grid(columns: list[str], rows: list[str], images: list[list], label_width: int = 180):
    """A PIL image: a header with the column names, each row labelled on the left."""
    import numpy as np
    from PIL import Image, ImageDraw

    from ..trainer.sampling import to_pixels
    h, w = images[0][0].shape[0], images[0][0].shape[1]
    cell_w, cell_h, header, pad = max(w, 96), max(h, 48), 22, 4
    grid = Image.new("RGB", (label_width + len(columns) * (cell_w + pad), header + len(rows) * (cell_h + pad)),
                     (24, 24, 28))
    draw = ImageDraw.Draw(grid)
    for c, name in enumerate(columns):
        draw.text((label_width + c * (cell_w + pad) + 4, 5), name, fill=(230, 230, 230))
    for r, label in enumerate(rows):
        y = header + r * (cell_h + pad)
        wrapped = textwrap.wrap(label, width=max(8, label_width // 7))[: max(1, cell_h // 12)]
        draw.multiline_text((4, y + 2), "\n".join(wrapped), fill=(200, 200, 200), spacing=2)
        for c, image in enumerate(images[r]):
            grid.paste(Image.fromarray(np.ascontiguousarray(to_pixels(image))), (label_width + c * (cell_w + pad), y))
    return grid


def compare_grid(models: dict, clip, vae, prompts: list[str], negative: str, seeds: list[int], *, steps: int,
                 cfg: float, sampler: str, scheduler: str, width: int, height: int, on_image=None):
    """Rows: every (prompt, seed); columns: the models, in order. Returns a PIL image."""
    from .previews import encode_prompt
    negative_cond = encode_prompt(clip, negative)
    rows, images = [], []
    for prompt in prompts:
        positive = encode_prompt(clip, prompt)
        for seed in seeds:
            rows.append(f"{prompt} (seed {seed})")
            row = []
            for model in models.values():
                row.append(sample_image(model, positive, negative_cond, seed, vae=vae, steps=steps, cfg=cfg,
                                        sampler=sampler, scheduler=scheduler, width=width, height=height))
                if on_image:
                    on_image()
            images.append(row)
    return labelled_grid(list(models), rows, images)
