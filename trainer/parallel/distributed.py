"""The engine a run trains on, chosen once: DeepSpeed where the layout needs it (several processes, ZeRO, a
pipeline, optimizer offload), else plain PyTorch in one process (trainer/parallel/plain_engine.py), which imports no
DeepSpeed; process-group set-up and the engine's configuration (the same dict for both)."""
from __future__ import annotations

import os
import socket

import torch


def ensure_dist_env():
    """A process started without a launcher is rank 0 of a world of 1."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def import_deepspeed():
    import deepspeed
    import deepspeed.ops
    # the shared-memory collective op costs a 44 s JIT compile on CPU and gloo does the job
    getattr(deepspeed.ops, "__compatible_ops__", {})["deepspeed_shm_comm"] = False
    return deepspeed


def set_cpu_threads(count: int) -> None:
    """torch.set_num_threads, leaving MKL as a process that never called it has it. Besides the thread count,
    torch's call turns MKL's dynamic threading off, after which every small matrix product runs on all threads:
    on 2 cores the steps after one evaluation (which runs on 1 thread) became 1.1-1.5 times slower and their
    speed varied from run to run (bench/overhead.py)."""
    torch.set_num_threads(count)
    if torch.backends.mkl.is_available():
        import ctypes
        try:
            mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
            mkl.MKL_Set_Dynamic(ctypes.c_int(1))  # MKL's default; its C interface takes the flag by value
        except (OSError, AttributeError):  # a build with MKL elsewhere: only speed is at stake
            pass


ENGINE_VARIABLE = "INGRAPH_TRAINER_ENGINE"  # "deepspeed": a one-process run on DeepSpeed's engine, to compare them


def uses_deepspeed(spec) -> bool:
    """The one rule: the spec's settings (DistributedSpec.needs_deepspeed), or a launcher that started several
    processes."""
    return spec.distributed.needs_deepspeed or world_size() > 1 or os.environ.get(ENGINE_VARIABLE) == "deepspeed"


def init_distributed():
    ensure_dist_env()
    local_world = processes_per_machine()
    if not torch.cuda.is_available() and local_world > 1:  # CPU processes share the cores, not oversubscribe them
        set_cpu_threads(max(1, (os.cpu_count() or 1) // local_world))
    deepspeed = import_deepspeed()
    backend = None if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return deepspeed


def global_min(value: float, device) -> float:
    """The smallest of every process's value (each process gets the same answer; its own where it runs alone)."""
    if world_size() == 1 or not torch.distributed.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return t.item()


def data_parallel_size(spec) -> int:
    """Model replicas training side by side: every process, or every pipeline of `pipeline_stages` processes."""
    return world_size() // spec.distributed.pipeline_stages


def deepspeed_config(spec) -> dict:
    t = spec.train
    config = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * data_parallel_size(spec),
        "gradient_clipping": t.max_grad_norm if t.max_grad_norm > 0 else 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": spec.distributed.zero_stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # offload with torch's AdamW or bitsandbytes' (no 1-minute JIT)
        "bf16": {"enabled": t.precision == "bf16"},
        # dynamic loss scaling from 2^16, halved on overflow, doubled after 1000 clean steps (plain_engine's too)
        "fp16": {"enabled": t.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1},
    }
    if spec.distributed.offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if spec.distributed.offload_params:  # zero.Init (partitioned_load) reads it too: the partitions start there
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    per_machine = processes_per_machine()
    if spec.distributed.zero_stage == 3 and 1 < per_machine < world_size():
        # ZeRO++ hpZ: a second copy of each weight partitioned within a machine, so the forward and backward
        # gathers stay inside it and only gradients cross machines (the role of FSDP's hybrid sharding)
        config["zero_optimization"]["zero_hpz_partition_size"] = per_machine
    return config


def processes_per_machine() -> int:
    """torchrun says LOCAL_WORLD_SIZE; DeepSpeed's launcher (the Train node's, with a hostfile) says LOCAL_SIZE."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def destroy():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
