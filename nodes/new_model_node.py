from comfy_api.latest import io

from .types import CATEGORY

# what the node offers: family name in trainer/models → label (families with a from-scratch builder)
FAMILY_LABELS = {"SD3 (MMDiT, flow matching)": "sd3", "Wan 2.1 (DiT, flow matching)": "wan"}
SIZES = ["tiny", "small", "medium"]


class NewModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphNewModel",
            display_name="New Model (train from scratch)",
            category=CATEGORY,
            description="A freshly initialised diffusion model of a family, at a size you choose, to train from "
                        "scratch: connect it to Train LoRA with a LoRA Adapter of kind 'Full fine-tune'. ComfyUI "
                        "treats it like any model of that family (sampling, Load Diffusion Model for the result).",
            inputs=[
                io.Combo.Input("family", options=list(FAMILY_LABELS), default=list(FAMILY_LABELS)[0],
                               tooltip="Architecture and objective. Both are rectified-flow transformers with 16 "
                                       "latent channels (use a VAE with 16 channels: SD3, Flux or Wan 2.1 image "
                                       "latents)."),
                io.Combo.Input("size", options=SIZES, default="tiny",
                               tooltip="tiny: under a million parameters (seconds per step on a CPU, for trying the "
                                       "graph). small: tens of millions. medium: SD3-medium-like width / Wan 2.1 "
                                       "1.3B, for real runs on GPUs."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=False,
                             tooltip="Seed of the random initial weights."),
                io.Clip.Input("clip", optional=True,
                              tooltip="The text encoder you will caption with: the new model takes text (and "
                                      "pooled) embeddings of its widths. Not connected: the size's own widths."),
            ],
            outputs=[io.Model.Output(display_name="model", tooltip="The untrained model.")],
        )

    @classmethod
    def execute(cls, family, size, seed, clip=None) -> io.NodeOutput:
        from ..trainer.comfy_compat import model_from_state_dict
        from ..trainer.models import SCRATCH_FAMILIES, UnsupportedSetting
        if family not in FAMILY_LABELS:
            raise ValueError(f"family: {family!r} is not one of {list(FAMILY_LABELS)}")
        builder = SCRATCH_FAMILIES[FAMILY_LABELS[family]]
        if size not in builder.scratch_sizes:
            raise ValueError(f"size: {family} offers {list(builder.scratch_sizes)}, not {size!r}")
        dims = builder.scratch_sizes[size]
        if clip is not None:
            text = clip.encode_from_tokens(clip.tokenize(""), return_pooled=True, return_dict=True)
            pooled = text.get("pooled_output")
            try:
                dims = builder.scratch_size_for_text(dims, int(text["cond"].shape[-1]),
                                                     int(pooled.shape[-1]) if pooled is not None else None)
            except UnsupportedSetting as exc:
                raise ValueError(f"New Model ({family}): {exc}") from None
        state = builder.scratch_state_dict(seed, **dims)
        model = model_from_state_dict(state)
        if model is None:
            raise RuntimeError(f"ComfyUI did not recognise the new {family} model (a ComfyUI version mismatch?)")
        return io.NodeOutput(model)
