"""Block swap: peak accelerator memory and step time of LoRA training with no swapped blocks and with N,
in one process, on a KOALA-700M-shaped SDXL-family UNet (about 400M parameters, random weights).

The same seeded batches run through both models; the losses and the adapter's gradients must agree (block
swap moves frozen weights, it must not change the numbers). Memory is only measurable on a GPU; on a CPU the
script reports time and agreement.

    python bench/block_swap.py [--swap 6 --steps 4 --batch 2 --resolution 128 --precision bf16]
Swapped blocks run twice: their copies made when each block runs (the trainer's, memory.BlockCopies), and the
next block copied ahead on a side stream (BlockCopies(ahead=True)). The last lines hold the ratios: copy ahead over blocking, and
swap over no swap, of peak memory and step time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build(state: dict, swap: int, device, dtype, ahead: bool = True):
    import comfy.sd
    import torch
    from ingraph_trainer.trainer.adapters import inject_adapter
    from ingraph_trainer.trainer.parallel.memory import enable_block_swap
    from ingraph_trainer.trainer.models import family_for
    patcher = comfy.sd.load_diffusion_model_state_dict(dict(state), model_options={"dtype": torch.float32})
    family = family_for(patcher.model, patcher=patcher)
    torch.manual_seed(0)
    params = inject_adapter(family.diffusion_model, family.adapter_targets("attention"), "lora", 16, 16.0, 0.0)
    with torch.no_grad():  # a LoRA some steps in: the up weights are no longer zero
        for p in params:
            p.normal_(0.0, 0.01)
    family.diffusion_model.to(device, dtype)  # as DeepSpeed's bf16 mode casts the whole module
    if swap:
        import functools
        from ingraph_trainer.trainer.parallel.memory import BlockCopies
        enable_block_swap(family.checkpoint_blocks()[:swap], device, copies=functools.partial(BlockCopies, ahead=ahead))
    return family, params


def measure(family, params, device, steps: int, batch: int, latent: int):
    import torch
    from ingraph_trainer.trainer.models import Batch
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses, grads = [], [], None
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        b = Batch(latents=torch.randn(batch, 4, latent, latent, generator=g).to(device),
                  cond=torch.randn(batch, 77, 2048, generator=g).to(device),
                  pooled=torch.randn(batch, 1280, generator=g).to(device),
                  noise=torch.randn(batch, 4, latent, latent, generator=g).to(device),
                  timesteps=torch.rand(batch, generator=g).to(device))
        t0 = time.perf_counter()
        loss = family.loss(b)
        loss.backward()
        if step == 0:
            grads = torch.cat([p.grad.detach().float().flatten() for p in params]).cpu()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    return {"peak_mib": peak, "step_s": statistics.median(times[1:] or times), "losses": losses, "grads": grads}


def main(argv=None):
    from tools.prepare_run import _bootstrap
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swap", type=int, default=6, help="blocks to swap")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--resolution", type=int, default=128, help="image side in pixels (latent side / 8)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    opts = parser.parse_args(argv)
    _bootstrap()
    import gc

    import torch
    from ingraph_trainer.trainer.models.sdxl import SDXLFamily
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if opts.precision == "bf16" else torch.float32
    state = SDXLFamily.scratch_state_dict(0, **SDXLFamily.scratch_sizes["koala"])
    results = {}
    for swap, ahead in ((0, True), (opts.swap, False), (opts.swap, True)):
        family, params = build(state, swap, device, dtype, ahead)
        results[(swap, ahead)] = measure(family, params, device, opts.steps, opts.batch, opts.resolution // 8)
        blocks = len(family.checkpoint_blocks())
        del family, params
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    plain, blocking, swapped = results[(0, True)], results[(opts.swap, False)], results[(opts.swap, True)]
    assert len(plain["losses"]) == len(blocking["losses"]) == len(swapped["losses"]) == opts.steps
    loss_diff = max(abs(a - b) for r in (blocking, swapped) for a, b in zip(plain["losses"], r["losses"]))
    grad_diff = max((plain["grads"] - r["grads"]).abs().max().item() for r in (blocking, swapped))
    print(f"SDXL-family UNet (~400M), LoRA rank 16 on attention, {opts.precision}, batch {opts.batch} at "
          f"{opts.resolution}px, {device.type} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'})")
    for (swap, ahead), r in results.items():
        how = "" if not swap else (", next block copied ahead" if ahead else ", copied when each block runs (the trainer's)")
        print(f"block_swap {swap:2d} of {blocks}{how}: peak memory {r['peak_mib']:.0f} MiB, step {r['step_s'] * 1000:.1f} ms, "
              f"losses {[round(x, 5) for x in r['losses']]}")
    print(f"agreement: max loss difference {loss_diff:.2e}, max first-step gradient difference {grad_diff:.2e}")
    print(f"copy ahead against blocking copies: step time {swapped['step_s'] / blocking['step_s']:.3f}, peak memory "
          f"{swapped['peak_mib'] / blocking['peak_mib']:.3f} (a CPU copies in place: only a GPU shows the overlap)")
    print(f"ratios (swap {opts.swap} / none, the trainer's copies): peak memory "
          f"{blocking['peak_mib'] / plain['peak_mib']:.3f}, step time {blocking['step_s'] / plain['step_s']:.3f}")


if __name__ == "__main__":
    main()
