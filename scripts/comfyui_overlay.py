"""Makes a second ComfyUI runnable from the pack's one environment: the packages its requirements.txt asks for that
the environment lacks, or holds at another version, go into an overlay folder put first on PYTHONPATH for that
ComfyUI alone (scripts/test.sh's ComfyUI 0.33 tier). torch and its companions are never touched; torchaudio, where
the ComfyUI imports it at start-up and no build matches the pinned torch, is a stand-in whose use raises
(tools/torchaudio_standin).

    python scripts/comfyui_overlay.py COMFYUI_DIR OVERLAY_DIR

Run with the environment's own Python. Each package goes in without its dependencies (they are the environment's);
the workflow-templates meta-package is left out: its media packages are large and only the template browser's
stock templates use them (ComfyUI logs a warning and runs).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

REPO = Path(__file__).resolve().parent.parent
NEVER = {"torch", "torchvision", "torchaudio", "comfyui-workflow-templates"}


def wanted(requirements: Path) -> list[str]:
    missing = []
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = req.name.lower().replace("_", "-")
        if name in NEVER or (req.marker and not req.marker.evaluate()):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(line)
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(line)
    return missing


def main(argv: list[str]) -> int:
    comfyui, overlay = Path(argv[0]), Path(argv[1])
    missing = wanted(comfyui / "requirements.txt")
    tmp = overlay.with_name(overlay.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if missing:
        print(f"comfyui_overlay: {comfyui.name} needs {', '.join(missing)}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
                        "--target", str(tmp), *missing], check=True)
    if "import torchaudio" in "".join(p.read_text(errors="ignore") for p in (comfyui / "comfy").rglob("*.py")):
        try:
            metadata.version("torchaudio")
        except metadata.PackageNotFoundError:
            shutil.copytree(REPO / "tools" / "torchaudio_standin" / "torchaudio", tmp / "torchaudio")
    shutil.rmtree(overlay, ignore_errors=True)
    tmp.rename(overlay)  # whole or not at all: setup's stamp is written only after this
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
