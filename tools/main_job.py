"""The main job: train a LoRA on the embedded default through a real, headless ComfyUI.

Makes a tiny random-weight SD1.5 checkpoint and a captioned image set, starts ComfyUI with this
pack, queues workflows/api/train_lora_api.json through POST /prompt, shows progress, prints where the
LoRA was written, and stops the server.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from client.api import ComfyClient  # noqa: E402
from client.cli import TerminalProgress, node_titles  # noqa: E402
from tools.comfy_server import ComfyServer, comfyui_available, comfyui_path  # noqa: E402
from runner.loss_chart import LOSS_CHART_FILE  # noqa: E402
from tools.embedded_default import build_checkpoint, build_images  # noqa: E402

CHECKPOINT_NAME = "ingraph_tiny_sd15.safetensors"
IMAGE_FOLDER = "ingraph_example"
WORKFLOW = REPO / "workflows" / "api" / "train_lora_api.json"


def prepare_base(base: Path):
    ckpt = base / "models" / "checkpoints" / CHECKPOINT_NAME
    if not ckpt.exists():
        print(f"making the embedded default checkpoint {ckpt} ...", flush=True)
        build_checkpoint(ckpt)
    images = base / "input" / IMAGE_FOLDER
    if not images.exists():
        build_images(images, count=8, size=64)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-dir", type=Path, default=Path(os.environ.get("INGRAPH_WORK_DIR", REPO / ".work" / "main_job")),
                        help="ComfyUI base directory for this job (models, input, output)")
    parser.add_argument("--steps", type=int, default=None, help="override the workflow's training steps")
    opts = parser.parse_args(argv)
    if not comfyui_available():
        print(f"ComfyUI not found at {comfyui_path()}: set COMFYUI_PATH", file=sys.stderr)
        return 2
    base = opts.base_dir.resolve()
    prepare_base(base)
    workflow = json.loads(WORKFLOW.read_text())
    if opts.steps:
        workflow["6"]["inputs"]["steps"] = opts.steps
    server = ComfyServer(base)
    print(f"starting ComfyUI ({comfyui_path()}) on {server.address}, base directory {base} ...", flush=True)
    t0 = time.monotonic()
    with server:
        print(f"ComfyUI ready in {time.monotonic() - t0:.1f} s; queueing {WORKFLOW.name}", flush=True)
        client = ComfyClient(server.address)
        outcome = client.run(workflow, timeout=3600, on_message=TerminalProgress(sys.stdout, node_titles(workflow)))
        client.close()
        if not outcome.ok:
            err = outcome.error or {}
            print(f"\nFAILED: {outcome.status}: {err.get('exception_message', '')}", file=sys.stderr)
            print(server.log_tail(30), file=sys.stderr)
            return 1
        lora_name = workflow["6"]["inputs"]["output_name"] + ".safetensors"
        lora_path = base / "models" / "loras" / lora_name
        run_dir = next(Path(d["event"]["run_dir"]) for d in outcome.of_type("ingraph.event")
                       if d["event"].get("type") == "started")
        samples = sorted((base / "output").glob(f"{workflow['13']['inputs']['filename_prefix']}_*.png"))
        print(f"\nLoRA written to {lora_path}")
        print(f"run folder (events, checkpoints, TensorBoard): {run_dir}")
        print(f"loss chart: {run_dir / LOSS_CHART_FILE}")
        print(f"sample with the trained LoRA: {samples[-1] if samples else 'none saved'}")
    return 0 if lora_path.is_file() else 1


if __name__ == "__main__":
    sys.exit(main())
