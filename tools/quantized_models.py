"""Quantized copies of a diffusion model, written with ComfyUI's own quantization code (ComfyUI 0.33 and later:
`comfy/quant_ops.py`), as the files users generate with: every linear layer of the diffusion model in one
`QuantizedTensor` layout, the rest as it was, each quantized layer's `comfy_quant` entry naming its format (what
ComfyUI itself writes when it saves a quantized model). UNETLoader loads the result with its mixed-precision ops.

    python tools/quantized_models.py --source CKPT_OR_UNET --out DIR --layouts float8_e4m3fn int8_tensorwise mxfp8

writes DIR/<stem>_<layout>.safetensors for each layout, and prints one JSON line: layout → {path, quantized_layers,
skipped_layers, bytes}. A layer whose width the layout cannot take (mxfp8 blocks of 32, nvfp4 of 16) is left in
full precision and counted as skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.prepare_run import _bootstrap  # noqa: E402  (ComfyUI on sys.path, the pack as ingraph_trainer)

CHECKPOINT_PREFIX = "model.diffusion_model."


def diffusion_state(source: Path) -> dict:
    """The diffusion model's tensors of a checkpoint or a diffusion-model file, keyed as in a diffusion-model file."""
    import comfy.utils
    state = comfy.utils.load_torch_file(str(source), safe_load=True)
    if any(k.startswith(CHECKPOINT_PREFIX) for k in state):
        return {k[len(CHECKPOINT_PREFIX):]: v for k, v in state.items() if k.startswith(CHECKPOINT_PREFIX)}
    return dict(state)


def linear_weights(state: dict) -> list[str]:
    """The layers whose weight is a matrix: the diffusion model's linear layers (convolutions are 4-D)."""
    return sorted(k[:-len(".weight")] for k, v in state.items()
                  if k.endswith(".weight") and v.ndim == 2 and v.is_floating_point() and min(v.shape) > 1)


def quantize_state(state: dict, layout_name: str) -> tuple[dict, int, int]:
    """(quantized state, layers quantized, layers skipped)."""
    import torch
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor
    if layout_name not in QUANT_ALGOS:
        raise SystemExit(f"--layouts: {layout_name!r} is not a layout this ComfyUI defines ({', '.join(QUANT_ALGOS)})")
    layout = QUANT_ALGOS[layout_name]["comfy_tensor_layout"]
    out, quantized, skipped = dict(state), 0, 0
    for layer in linear_weights(state):
        weight = state[f"{layer}.weight"].float()
        try:
            q = QuantizedTensor.from_float(weight, layout)
        except (ValueError, RuntimeError, AssertionError):  # a width the layout's blocks do not divide
            skipped += 1
            continue
        del out[f"{layer}.weight"]
        out.update({k: v.contiguous() for k, v in q.state_dict(f"{layer}.weight").items()})
        conf = json.dumps({"format": layout_name}).encode()
        out[f"{layer}.comfy_quant"] = torch.tensor(list(conf), dtype=torch.uint8)
        quantized += 1
    return out, quantized, skipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="a checkpoint or diffusion-model file")
    parser.add_argument("--out", type=Path, required=True, help="folder for <stem>_<layout>.safetensors")
    parser.add_argument("--layouts", nargs="+", required=True, help="QUANT_ALGOS names (comfy/quant_ops.py)")
    args = parser.parse_args(argv)
    _bootstrap()
    from tools.embedded_default import save_safetensors
    state = diffusion_state(args.source)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {}
    for layout in args.layouts:
        quantized, count, skipped = quantize_state(state, layout)
        if count == 0:
            raise SystemExit(f"--layouts {layout}: no layer of {args.source} could be quantized")
        path = args.out / f"{args.source.stem}_{layout}.safetensors"
        save_safetensors(quantized, path)
        report[layout] = {"path": str(path), "quantized_layers": count, "skipped_layers": skipped,
                          "bytes": path.stat().st_size}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
