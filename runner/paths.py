"""Where the pack keeps its files inside a ComfyUI install."""
from __future__ import annotations

import os
from pathlib import Path


def _output_root() -> Path:
    import folder_paths
    return Path(folder_paths.get_output_directory()) / "ingraph"


def cache_root() -> Path:
    return Path(os.environ.get("INGRAPH_CACHE_DIR") or _output_root() / "cache")


def runs_root() -> Path:
    return _output_root() / "runs"


def evals_root() -> Path:
    return _output_root() / "evals"


def models_root() -> Path:
    return _output_root() / "models"


def comfyui_root() -> str:
    import folder_paths
    return str(Path(folder_paths.__file__).resolve().parent)


def resolve_input_folder(folder: str) -> Path:
    """An absolute path as given; anything else relative to ComfyUI's input directory."""
    import folder_paths
    path = Path(folder.strip()).expanduser()
    return path if path.is_absolute() else Path(folder_paths.get_input_directory()) / path


def output_folder(adapter_kind: str) -> str:
    """The models/ folder a run's result goes to: adapters for Load LoRA, full fine-tunes for Load Diffusion Model."""
    return "diffusion_models" if adapter_kind == "full" else "loras"


def lora_output_path(output_name: str, folder: str = "loras") -> tuple[Path, str]:
    """(absolute file in the first models/<folder> folder, the name the loader lists it under).

    folder: "loras" for adapters (Load LoRA), "diffusion_models" for full fine-tunes (Load Diffusion Model)."""
    import folder_paths
    name = output_name.strip().replace("\\", "/")
    if name.endswith(".safetensors"):
        name = name[: -len(".safetensors")]
    parts = [p for p in name.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts) or name.startswith("/"):
        raise ValueError(f"output_name {output_name!r} must be a file name, optionally with sub-folders, "
                         f"inside models/{folder}")
    relative = "/".join(parts) + ".safetensors"
    return Path(folder_paths.get_folder_paths(folder)[0]) / relative, relative


def lora_name_of(path: str | Path, folder_name: str = "loras") -> str:
    """The name a loader lists a file under (relative to a models/<folder_name> folder), else its file name."""
    import folder_paths
    path = Path(path).resolve()
    for folder in folder_paths.get_folder_paths(folder_name):
        try:
            return path.relative_to(Path(folder).resolve()).as_posix()
        except ValueError:
            continue
    return path.name
