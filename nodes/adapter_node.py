from comfy_api.latest import io

from ..trainer.spec import TARGET_CHOICES, AdapterSpec, choice_labels, choices_tooltip, choice_value
from .types import CATEGORY, Adapter

KINDS = {"LoRA": "lora", "LoHa": "loha", "LoKr": "lokr", "DoRA": "dora", "Full fine-tune": "full"}


def _lora_files() -> list[str]:
    import folder_paths
    return folder_paths.get_filename_list("loras")


class LoRAAdapter(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphLoRAAdapter",
            display_name="LoRA Adapter",
            category=CATEGORY,
            description="Settings of the adapter to train (LoRA or one of its LyCORIS relatives). Every kind is "
                        "saved with the keys ComfyUI's Load LoRA reads.",
            inputs=[
                io.Combo.Input("kind", options=list(KINDS), default="LoRA",
                               tooltip="LoRA: low-rank update. LoHa: Hadamard product of two low-rank updates (more "
                                       "expressive at the same rank). LoKr: Kronecker product (very small files). "
                                       "DoRA: LoRA plus a learned magnitude per output channel. Full fine-tune: every "
                                       "weight trains (rank, alpha, dropout and targets unused); saved as a diffusion "
                                       "model for Load Diffusion Model."),
                io.Int.Input("rank", default=16, min=1, max=1024,
                             tooltip="Rank (network dim): larger learns more detail and makes a bigger file. LoKr "
                                     "uses it for the factored part and keeps small factors whole."),
                io.Float.Input("alpha", default=16.0, min=0.01, max=4096.0, step=0.01,
                               tooltip="LoRA alpha: the update is scaled by alpha / rank. Saved as-is in the file."),
                io.Float.Input("dropout", default=0.0, min=0.0, max=0.9, step=0.01,
                               tooltip="Dropout on the adapter path during training (LoHa/LoKr: rank dropout; "
                                       "0 = off)."),
                io.Combo.Input("targets", options=choice_labels(TARGET_CHOICES), default="attention",
                               tooltip="Which layers get an adapter. " + choices_tooltip(TARGET_CHOICES)),
                io.Combo.Input("continue_from", options=["none", *_lora_files()], default="none", optional=True,
                               tooltip="Start from an adapter this pack trained (same kind, rank and targets; any "
                                       "file format) instead of from scratch. none: a new adapter."),
            ],
            outputs=[Adapter.Output(display_name="adapter", tooltip="Adapter settings for Train LoRA.")],
        )

    @classmethod
    def execute(cls, kind, rank, alpha, dropout, targets, continue_from="none") -> io.NodeOutput:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)} (got {kind!r})")
        if rank < 1:
            raise ValueError(f"rank must be at least 1 (got {rank})")
        targets = choice_value(TARGET_CHOICES, targets, "targets")
        init_from = ""
        if continue_from and continue_from != "none":
            import folder_paths
            init_from = folder_paths.get_full_path("loras", continue_from) or ""
            if not init_from:
                raise ValueError(f"continue_from: {continue_from} is not in models/loras")
            if KINDS[kind] == "full":
                raise ValueError("continue_from: a full fine-tune starts from the MODEL; load the model instead")
        return io.NodeOutput(AdapterSpec(kind=KINDS[kind], rank=rank, alpha=float(alpha), dropout=float(dropout),
                                         targets=targets, init_from=init_from))
