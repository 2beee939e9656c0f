"""The run's result: the adapter file (or, for a full fine-tune, the diffusion model), written by rank 0 with
the weights every process helped gather."""
from __future__ import annotations

import json
from pathlib import Path

from . import export
from .adapters import PACK_METADATA_KEY, comfy_adapter_state_dict, kohya_metadata, save_adapter_atomic, written_by_pack


def write_result(spec, family, params, layout, is_rank0: bool, num_images: int, steps_done: int,
                 started_at: float) -> str | None:
    """The written file's path on rank 0 (None elsewhere). Collective: every rank calls it."""
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
    else:
        # DoRA's export reads the base weights too; under ZeRO-3 they are sharded like the rest
        export_params = list(family.diffusion_model.parameters()) if a.kind == "dora" else params
        with layout.gathered(export_params):  # collective: every rank enters
            tensors = comfy_adapter_state_dict(family.diffusion_model, a.kind, a.alpha, spec.output.format)
        tensors = export.convert(tensors, spec.output.format, export.diffusers_module_names(family.base_model)
                                 if spec.output.format != "comfyui" else {})
        meta = kohya_metadata(spec, family, num_images, steps_done, started_at)
    if not is_rank0:
        return None
    target = Path(spec.output.lora_path)
    if target.exists() and not spec.output.overwrite and not written_by_pack(target):
        # a file of the user's appeared there during the run: never replaced silently, and the result is kept
        kept = save_adapter_atomic(run_dir / target.name, tensors, meta)
        raise FileExistsError(f"{target} exists and was not written by InGraph Trainer, so it was left alone; "
                              f"this run's result is in {kept} (turn on overwrite to replace such a file)")
    return str(save_adapter_atomic(target, tensors, meta))
