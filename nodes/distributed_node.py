from comfy_api.latest import io

from ..trainer.spec import DistributedSpec
from .types import CATEGORY, Distributed


class DeepSpeedSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="InGraphDeepSpeedSettings",
            display_name="DeepSpeed Settings",
            category=CATEGORY,
            description="How Train LoRA runs: how many processes (GPUs), ZeRO memory sharding, optimizer and "
                        "weight offload, and a hostfile for several machines. Without this node a run uses one "
                        "process.",
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
                io.Int.Input("pipeline_stages", default=1, min=1, max=64, optional=True,
                             tooltip="Split the model's layers across this many processes (pipeline parallel, "
                                     "partitioned by trainable parameters), for models too big for one GPU. "
                                     "Must divide the number of processes; the rest is data parallel. Takes ZeRO "
                                     "0 or 1; no previews. A model family that does not split is refused when "
                                     "queued, naming this input (the README lists those that do)."),
                io.Boolean.Input("offload_params", default=False, optional=True,
                                 tooltip="ZeRO stage 3: keep each GPU's share of the model's weights in CPU memory "
                                         "and fetch each layer's weights to the GPUs as it runs (the least GPU "
                                         "memory for a model too big for the cards, slower steps)."),
                io.Int.Input("block_swap", default=0, min=0, max=1000, optional=True,
                             tooltip="Adapter training on one stage: keep this many blocks' frozen weights in CPU "
                                     "memory and copy each to the GPU only while it runs (less GPU memory, slower "
                                     "steps; those blocks are recomputed in the backward pass). 0 = off."),
            ],
            outputs=[Distributed.Output(display_name="distributed", tooltip="Connect to Train LoRA.")],
        )

    @classmethod
    def execute(cls, processes, zero_stage, offload_optimizer, hostfile, pipeline_stages=1,
                block_swap=0, offload_params=False) -> io.NodeOutput:
        spec = DistributedSpec(processes=processes, zero_stage=int(zero_stage), offload_optimizer=offload_optimizer,
                               hostfile=hostfile.strip(), pipeline_stages=pipeline_stages, block_swap=block_swap,
                               offload_params=offload_params)
        problems = spec.problems()
        if problems:
            raise ValueError("DeepSpeed Settings: " + "; ".join(problems))
        return io.NodeOutput(spec)
