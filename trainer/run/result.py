"""The run's result: the adapter file (or, for a full fine-tune, the diffusion model), written by rank 0 with
the weights every process helped gather."""
from __future__ import annotations

import json
from pathlib import Path

from .. import export
from ..adapters import PACK_METADATA_KEY, comfy_adapter_state_dict, kohya_metadata, save_adapter_atomic, written_by_pack


PREVIOUS_SUFFIX = ".previous"  # the pack's own earlier result of that name, one kept


def keep_a_copy(target: Path) -> Path | None:
    """Before a result replaces a file, a copy of that file stays beside it: `<name>.previous.safetensors` for the
    pack's own earlier result (one, the last replaced), `<name>.bak-<time>.safetensors` for a file the pack did not
    write (replaced because `overwrite` is on; the pack never deletes these). A hard link where the file system has
    them (no bytes copied), else a copy; the target itself stays in place until the atomic write replaces it.
    Returns the copy, or None where there was nothing to replace."""
    import os
    import shutil
    import time
    if not target.is_file():
        return None
    stem = target.name[: -len(".safetensors")] if target.name.endswith(".safetensors") else target.stem
    if written_by_pack(target):
        copy = target.with_name(f"{stem}{PREVIOUS_SUFFIX}.safetensors")
        copy.unlink(missing_ok=True)
    else:
        copy = target.with_name(f"{stem}.bak-{time.strftime('%Y%m%d-%H%M%S')}.safetensors")
        n = 1
        while copy.exists():
            n += 1
            copy = target.with_name(f"{stem}.bak-{time.strftime('%Y%m%d-%H%M%S')}-{n}.safetensors")
    try:
        os.link(target, copy)
    except OSError:
        shutil.copy2(target, copy)
    return copy


def write_result(spec, family, params, layout, is_rank0: bool, num_images: int, steps_done: int,
                 started_at: float, gradient_checkpointing: bool | None = None) -> tuple[str | None, str | None]:
    """(the written file's path, the copy kept of the file it replaced, if any) on rank 0; (None, None) elsewhere.
    Collective: every rank calls it."""
    a, run_dir = spec.adapter, Path(spec.run_dir)
    if a.kind == "full":
        tensors = {}
        for name, param in family.diffusion_model.named_parameters():  # one at a time: never the whole
            with layout.gathered([param]):                             # model twice in memory
                if is_rank0:
                    tensors[name] = param.detach().to("cpu").clone()
        for name, buffer in family.diffusion_model.named_buffers():
            tensors[name] = buffer.detach().to("cpu").clone()
        meta = {PACK_METADATA_KEY: json.dumps({"spec_version": spec.version, "family": family.name,
                                               "prediction": family.prediction, "kind": "full",
                                               "steps": steps_done})}
        if is_rank0:  # what ComfyUI's loader needs beside the weights to build the same model (LTX-2's sizes...)
            from ..models.file_metadata import config_metadata
            meta.update(config_metadata(family.base_model, tensors))
    else:
        # DoRA's export reads the base weights too; under ZeRO-3 they are sharded like the rest
        export_params = list(family.diffusion_model.parameters()) if a.kind == "dora" else params
        with layout.gathered(export_params):  # collective: every rank enters
            tensors = comfy_adapter_state_dict(family.diffusion_model, a.kind, a.alpha, spec.output.format)
        tensors = export.convert(tensors, spec.output.format, export.diffusers_module_names(family.base_model)
                                 if spec.output.format != "comfyui" else {})
        meta = kohya_metadata(spec, family, num_images, steps_done, started_at, gradient_checkpointing)
    if not is_rank0:
        return None, None
    target = Path(spec.output.lora_path)
    # a full fine-tune's target could be any base model: overwrite never applies to it
    if target.exists() and (a.kind == "full" or not spec.output.overwrite) and not written_by_pack(target):
        # a file of the user's appeared there during the run: never replaced silently, and the result is kept
        kept = save_adapter_atomic(run_dir / target.name, tensors, meta)
        raise FileExistsError(f"{target} exists and was not written by InGraph Trainer, so it was left alone; "
                              f"this run's result is in {kept} (turn on overwrite to replace such a file)")
    kept = keep_a_copy(target)
    return str(save_adapter_atomic(target, tensors, meta)), str(kept) if kept else None
