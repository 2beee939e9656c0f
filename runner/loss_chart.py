"""The loss chart the Train node outputs: raw and smoothed training loss, plus evaluation points."""
from __future__ import annotations

from pathlib import Path


def smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for n, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** n))
    return out


def render_loss_chart(steps: list[int], losses: list[float], evals: list[tuple[int, float]] = (),
                      width: int = 640, height: int = 360):
    """Returns a PIL image."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (width, height), (24, 24, 28))
    draw = ImageDraw.Draw(img)
    left, right, top, bottom = 56, 16, 24, 36
    pw, ph = width - left - right, height - top - bottom
    draw.rectangle([left, top, left + pw, top + ph], outline=(90, 90, 100))
    values = list(losses) + [v for _, v in evals]
    if not values:
        draw.text((left + 8, top + 8), "no training steps", fill=(200, 200, 200))
        return img
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    max_step = max([*steps, *(s for s, _ in evals), 1])

    def xy(step, value):
        return (left + pw * step / max_step, top + ph * (1 - (value - lo) / (hi - lo)))

    if len(losses) > 1:
        draw.line([xy(s, v) for s, v in zip(steps, losses)], fill=(90, 120, 200), width=1)
        draw.line([xy(s, v) for s, v in zip(steps, smooth(losses))], fill=(120, 200, 255), width=2)
    elif losses:
        x, y = xy(steps[0], losses[0])
        draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=(120, 200, 255))
    for s, v in evals:
        x, y = xy(s, v)
        draw.ellipse([x - 4, y - 4, x + 4, y + 4], outline=(255, 170, 60), width=2)
    draw.text((4, top - 4), f"{hi:.4g}", fill=(200, 200, 200))
    draw.text((4, top + ph - 8), f"{lo:.4g}", fill=(200, 200, 200))
    draw.text((left, height - 28), "0", fill=(200, 200, 200))
    draw.text((left + pw - 40, height - 28), f"step {max_step}", fill=(200, 200, 200))
    draw.text((left + 8, 4), "loss (raw, smoothed)   o eval", fill=(220, 220, 220))
    return img


LOSS_CHART_FILE = "loss_chart.png"  # in the run's folder: ComfyUI empties temp/, where PreviewImage puts it


def save_loss_chart(img, run_dir) -> Path:
    """The chart as a PNG in the run's folder, written whole or not at all."""
    import io

    from ..cache.files import atomic_write_bytes
    data = io.BytesIO()
    img.save(data, format="PNG")
    return atomic_write_bytes(Path(run_dir) / LOSS_CHART_FILE, data.getvalue())


def chart_tensor(img):
    import numpy as np
    import torch
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).unsqueeze(0)


def render_quantile_chart(results: dict[str, dict], width: int = 640, height: int = 360):
    """Evaluation loss by timestep quantile, one line per evaluated model, with each mean in the legend."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (width, height), (24, 24, 28))
    draw = ImageDraw.Draw(img)
    left, right, top, bottom = 56, 16, 40, 36
    pw, ph = width - left - right, height - top - bottom
    draw.rectangle([left, top, left + pw, top + ph], outline=(90, 90, 100))
    values = [v for r in results.values() for v in r["quantiles"].values()]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5

    def xy(q, value):
        return (left + pw * q, top + ph * (1 - (value - lo) / (hi - lo)))

    colours = [(120, 200, 255), (255, 170, 60), (140, 220, 120), (230, 110, 160)]
    for n, (name, result) in enumerate(results.items()):
        colour = colours[n % len(colours)]
        points = [xy(float(q), v) for q, v in result["quantiles"].items()]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        for x, y in points:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        draw.text((left + 8 + 200 * n, 6), f"{name}: mean {result['loss']:.5g}", fill=colour)
    draw.text((4, top - 4), f"{hi:.4g}", fill=(200, 200, 200))
    draw.text((4, top + ph - 8), f"{lo:.4g}", fill=(200, 200, 200))
    for q in (0.0, 0.5, 1.0):
        draw.text((left + pw * q - (8 if q else 0), height - 28), f"{q:g}", fill=(200, 200, 200))
    draw.text((left + pw // 2 - 60, height - 14), "timestep quantile (noise level)", fill=(200, 200, 200))
    return img
