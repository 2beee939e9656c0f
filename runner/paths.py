"""Where the pack keeps its files inside a ComfyUI install."""
from __future__ import annotations

import os
from pathlib import Path

from ..trainer.run.layout import DATA_DIR_ENV, DATA_FOLDER  # noqa: F401  (DATA_DIR_ENV: the operator's setting)


def _output_root() -> Path:
    import folder_paths
    return Path(folder_paths.get_output_directory()) / "ingraph"


def data_root() -> Path:
    """The pack's files that no client may read or replace: the dataset cache and the model copies it materialises.
    Any client reads output/ (GET /view) and writes it (POST /upload/image with type=output), so they live beside it,
    in ComfyUI's base directory (`--base-directory`, else ComfyUI's own folder), which ComfyUI serves nothing from;
    or where the operator's environment variable INGRAPH_DATA_DIR says (no node input can move it)."""
    import folder_paths
    # absolute: run specs name these paths, and the trainer runs in another working folder
    return Path(os.path.abspath(os.environ.get(DATA_DIR_ENV) or Path(folder_paths.base_path) / DATA_FOLDER))


def use_data_folder_secret() -> Path:
    """The secret that signs this server's runs: the file the operator names in INGRAPH_SECRET_FILE, else `secret`
    in the data folder, so two servers sharing a home (and so ~/.config) do not trust each other's runs. Set for
    this process and the trainers it starts. A server that signed with the home folder's secret before moves to
    its data folder's the first time, re-signing the runs in its output folder that the old secret signed."""
    from ..trainer.run.trust import SECRET_ENV, home_secret_path, installation_secret, migrate_runs
    if os.environ.get(SECRET_ENV):
        return Path(os.environ[SECRET_ENV])
    import hashlib
    import logging
    log = logging.getLogger("ingraph_trainer")
    path = data_root() / "secret"
    os.environ[SECRET_ENV] = str(path)
    try:
        installation_secret(path)
    except (OSError, ValueError) as exc:  # the pack still loads: each run then fails naming the file
        log.error("InGraph Trainer: this server's secret %s cannot be used (%s)", path, exc)
        return path
    # once per output folder, until it succeeds (a run signed with the home secret later is another server's)
    done = path.with_name(f"secret.moved-{hashlib.sha256(str(runs_root()).encode()).hexdigest()[:16]}")
    if home_secret_path().is_file() and not done.exists():
        try:
            moved = migrate_runs([runs_root(), evals_root()], home_secret_path())
            done.write_text(f"{runs_root()}\n", encoding="utf-8")
        except Exception as exc:  # noqa: BLE001  never stops the pack's load: tried again at the next start
            log.warning("InGraph Trainer: the runs signed with %s were not all moved to %s yet (%s); tried again at "
                        "the next start", home_secret_path(), path, exc)
            return path
        if moved:
            log.info("InGraph Trainer: %d run signature(s) moved to this server's own secret (%s)", moved, path)
    return path


def cache_root() -> Path:
    return Path(os.path.abspath(os.environ.get("INGRAPH_CACHE_DIR") or data_root() / "cache"))


def runs_root() -> Path:
    return _output_root() / "runs"


def evals_root() -> Path:
    return _output_root() / "evals"


def models_root() -> Path:
    return data_root() / "models"


def comfyui_root() -> str:
    import folder_paths
    return str(Path(folder_paths.__file__).resolve().parent)


DATASET_ROOTS_ENV = "INGRAPH_DATASET_ROOTS"  # more folders datasets may come from (os.pathsep between them)


def dataset_roots() -> list[Path]:
    """Where a dataset folder may be: ComfyUI's input directory, and the roots the server's operator lists in
    INGRAPH_DATASET_ROOTS (the environment: no client can set it)."""
    import folder_paths
    listed = [p for p in os.environ.get(DATASET_ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    return [Path(os.path.abspath(p)) for p in (folder_paths.get_input_directory(), *listed)]


def resolve_input_folder(folder: str, input_name: str = "folder") -> Path:
    """A folder relative to ComfyUI's input directory, or an absolute one inside an allowed root (dataset_roots).
    Anything else is refused naming the input: any client can queue a graph, and a dataset's images and captions come
    back to every client through the run's files and the cache. The check is on the path as written (".." folded),
    so a folder a local user linked into input/ still trains."""
    import folder_paths
    path = Path(folder.strip()).expanduser()
    path = Path(os.path.abspath(path if path.is_absolute() else Path(folder_paths.get_input_directory()) / path))
    roots = dataset_roots()
    if not any(path == root or path.is_relative_to(root) for root in roots):
        raise ValueError(f"{input_name} {folder.strip()!r} is outside ComfyUI's input folder: datasets come from "
                         f"input/ and its sub-folders, or from a folder the server's operator lists in "
                         f"{DATASET_ROOTS_ENV}")
    return path


def output_folder(adapter_kind: str) -> str:
    """The models/ folder a run's result goes to: adapters for Load LoRA, full fine-tunes for Load Diffusion Model."""
    return "diffusion_models" if adapter_kind == "full" else "loras"


WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
UNPORTABLE_CHARS = set('<>:"|?*')  # refused by Windows (and ':' by macOS Finder)
MAX_NAME_CHARS = 200  # the whole relative name: fits Windows' 260-character paths under a short models folder
MAX_COMPONENT_BYTES = 255  # every file system's limit for one name
TEMP_NAME_EXTRA = len(".-XXXXXXXX.partial")  # the atomic writer's temporary name beside the target (adapters.py)


def lora_output_path(output_name: str, folder: str = "loras") -> tuple[Path, str]:
    """(absolute file in the first models/<folder> folder, the name the loader lists it under).

    folder: "loras" for adapters (Load LoRA), "diffusion_models" for full fine-tunes (Load Diffusion Model).
    The name is checked the way the strictest system would take it (Windows, macOS), temporary name included,
    and must not pass through an existing file."""
    import folder_paths
    name = output_name.strip().replace("\\", "/")
    if name.endswith(".safetensors"):
        name = name[: -len(".safetensors")]
    parts = [p for p in name.split("/") if p]

    def refuse(why: str):
        raise ValueError(f"output_name {output_name!r}: {why}")

    if not parts or any(p in (".", "..") for p in parts) or name.startswith("/"):
        refuse(f"must be a file name, optionally with sub-folders, inside models/{folder}")
    if len(name) > MAX_NAME_CHARS:
        refuse(f"is {len(name)} characters long; at most {MAX_NAME_CHARS}")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        bad = sorted({c for c in part if c in UNPORTABLE_CHARS or ord(c) < 32 or ord(c) == 127})
        if bad:
            refuse(f"{part!r} contains {', '.join(repr(c) for c in bad)}, which Windows or macOS cannot store")
        if part != part.rstrip(" .") or part != part.lstrip(" "):
            refuse(f"{part!r} starts with a space or ends with a space or a dot, which Windows cannot store")
        if part.split(".")[0].upper() in WINDOWS_RESERVED:
            refuse(f"{part!r} is a reserved device name on Windows")
        size = len(part.encode("utf-8")) + (len(".safetensors") if last else 0)
        if last:
            size = max(size, len(part.encode("utf-8")) + TEMP_NAME_EXTRA)
        if size > MAX_COMPONENT_BYTES:
            refuse(f"{part[:40]!r}... is too long for a file name ({size} bytes with its temporary name)")
    relative = "/".join(parts) + ".safetensors"
    base = Path(folder_paths.get_folder_paths(folder)[0])
    here = base
    for part in parts[:-1]:
        here = here / part
        if here.exists() and not here.is_dir():
            refuse(f"models/{folder}/{here.relative_to(base).as_posix()} is a file, not a folder")
    target = base / relative
    if target.is_dir():
        refuse(f"models/{folder}/{relative} is a folder")
    from ..trainer.os_support import path_problem
    too_long = path_problem(target.parent / ("." + parts[-1] + "x" * TEMP_NAME_EXTRA + ".safetensors"))
    if too_long:  # the temporary name beside it is the longest path written
        refuse(too_long)
    return target, relative


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
