from comfy_api.latest import io

from ..trainer.config import DistributedSpec
from .types import CATEGORY, Distributed


class DeepSpeedSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphDeepSpeedSettings",
            display_name="DeepSpeed Settings",
            category=CATEGORY,
            description="How Train LoRA runs: how many processes (GPUs), ZeRO memory sharding, optimizer offload, "
                        "and a hostfile for several machines. Without this node a run uses one process.",
            inputs=[
                io.Int.Input("processes", default=1, min=1, max=1024,
                             tooltip="Processes on this machine, normally one per GPU (data parallel)."),
                io.Combo.Input("zero_stage", options=["0", "1", "2", "3"], default="0",
                               tooltip="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also the weights "
                                       "across processes."),
                io.Boolean.Input("offload_optimizer", default=False,
                                 tooltip="Keep optimizer state in CPU memory (needs ZeRO stage 1 or more)."),
                io.String.Input("hostfile", default="",
                                tooltip="DeepSpeed hostfile for several machines ('host slots=N' per line); empty "
                                        "for this machine only. Every machine needs the same paths."),
            ],
            outputs=[Distributed.Output(display_name="distributed", tooltip="Connect to Train LoRA.")],
        )

    @classmethod
    def execute(cls, processes, zero_stage, offload_optimizer, hostfile) -> io.NodeOutput:
        spec = DistributedSpec(processes=processes, zero_stage=int(zero_stage), offload_optimizer=offload_optimizer,
                               hostfile=hostfile.strip())
        if spec.offload_optimizer and spec.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3")
        if spec.hostfile:
            from pathlib import Path
            if not Path(spec.hostfile).is_file():
                raise ValueError(f"hostfile {spec.hostfile} does not exist")
        return io.NodeOutput(spec)
