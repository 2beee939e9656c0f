"""Run by tests/unit/test_unit.py in a process of its own (DeepSpeed's process group stays out of the test process):
which tensors DeepSpeed's real engine start moves with Tensor.to(device), for a model whose first block is swapped
(memory.enable_block_swap), started through the trainer's layout (ParallelLayout.initialize) and, as the control,
by deepspeed.initialize alone. Prints one JSON line: {"layout": {...}, "control": {...}}."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.prepare_run import _bootstrap  # noqa: E402  (the pack as the package ingraph_trainer)

_bootstrap()


def model():
    import torch
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    adapter = torch.nn.Parameter(torch.zeros(4))
    blocks[0].register_parameter("adapter", adapter)  # trained: DeepSpeed's, on the device
    blocks.requires_grad_(False)
    adapter.requires_grad_(True)
    return blocks, adapter


def start(through_layout: bool) -> dict:
    import torch
    from ingraph_trainer.trainer.parallel import layouts, memory
    from ingraph_trainer.trainer.parallel.distributed import init_distributed
    deepspeed = init_distributed()
    blocks, adapter = model()
    memory.enable_block_swap([blocks[0]], torch.device("cpu"), torch.bfloat16)
    host = {blocks[0].weight.data_ptr(), blocks[0].bias.data_ptr()}
    moved, real_to = [], torch.Tensor.to

    def to(self, *args, **kwargs):  # DeepSpeed's module.to(device): every parameter's Tensor.to with a device
        if any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs:
            moved.append(self.data_ptr())
        return real_to(self, *args, **kwargs)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
              "gradient_clipping": 0.0}
    optimizer = torch.optim.AdamW([adapter])
    torch.Tensor.to = to
    try:
        if through_layout:
            layout = layouts.ParallelLayout.__new__(layouts.ParallelLayout)
            layout.module = blocks
            engine = layout.initialize(deepspeed, optimizer, None, config)
        else:
            engine, *_ = deepspeed.initialize(model=blocks, optimizer=optimizer, config=config)
    finally:
        torch.Tensor.to = real_to
    names = {p.data_ptr(): f"{i}.{n}" for i, b in enumerate(blocks) for n, p in b.named_parameters()}
    return {"host_moved": sorted(names.get(p, "?") for p in set(moved) & host),
            "others_moved": sorted(names[p] for p in set(moved) if p in names and p not in host),
            "host_still_there": [n for n, _ in blocks[0].named_parameters()],
            # DeepSpeed's parameter-name map (its checkpoints' frozen-parameter bookkeeping reads it)
            "unnamed": sorted(names[p.data_ptr()] for p in blocks.parameters() if p not in engine.param_names),
            "dtype": str(blocks[0].weight.dtype)}


if __name__ == "__main__":
    print(json.dumps({"layout": start(True), "control": start(False)}))
