"""Held-out loss at fixed timestep quantiles with fixed noise (diffusion-pipe's evaluation).

Deterministic on any number of processes: the batches are cut the same way whatever the world size,
each rank computes whole batches (round-robin), and the per-image losses are summed across ranks
into zeros, which is exact, before the mean is taken in one fixed order.
"""
from __future__ import annotations

import contextlib

import torch

from ..data.dataset_checks import has_audio
from ..data.loading import CachedDataset, each_tensor, seeded_generator
from ..parallel.distributed import rank, set_cpu_threads, world_size
from ..models import Batch

EVAL_NOISE_STREAM = 3  # generator stream of the evaluation noise (data/loading.py uses 1, 2, 4 and 5)
EVAL_AUDIO_NOISE_STREAM = 6  # and of its audio latents' noise


def eval_chunks(dataset: CachedDataset, indices: list[int], batch_size: int) -> list[list[int]]:
    """Batches of one bucket each, in a fixed order (independent of the number of processes)."""
    by_bucket: dict[tuple, list[int]] = {}  # (w, h), or (w, h, frames) for clips
    for i in indices:
        by_bucket.setdefault(dataset.buckets[i], []).append(i)
    return [group[s:s + batch_size] for _, group in sorted(by_bucket.items()) for s in range(0, len(group), batch_size)]


@contextlib.contextmanager
def layout_independent_threads(device):
    """CPU kernels split their sums by thread count, and CPU workers share the cores: one thread per computation
    makes the numbers independent of the number of processes. Yields how many computations may run side by side,
    each on a thread of its own (the process's CPU threads; 1 on a GPU)."""
    if torch.device(device).type != "cpu":
        yield 1
        return
    threads = torch.get_num_threads()
    set_cpu_threads(1)
    try:
        yield threads
    finally:
        set_cpu_threads(threads)


def eval_noise(shape, items: list[int], seed: int, stream: int = EVAL_NOISE_STREAM) -> torch.Tensor:
    """The fixed noise of each evaluated image (by its index), whatever batch or process computes it."""
    return torch.stack([torch.randn(shape, generator=seeded_generator(seed, stream, i)) for i in items])


def repeated_rows(x, times: int, device):
    """A batch field's rows `times` over (a chunk once per quantile), on the device; a list of tensors (the reference
    slots) or a dict of them (the text encoder's extras) keeps its type; None stays None."""
    return each_tensor(x, lambda t: (torch.cat([t] * times) if times > 1 else t).to(device))


def eval_subset(items: list[int], count: int, seed: int) -> list[int]:
    """The items a training run evaluates: all of them up to `count`, else a fixed subset drawn with the run's seed
    (the same on every resume, every rank and every evaluation, so the figures compare), in dataset order."""
    import random
    items = list(items)
    if count >= len(items):
        return items
    chosen = set(random.Random(seed).sample(items, count))
    return [item for item in items if item in chosen]


def evaluate(module, dataset: CachedDataset, indices: list[int], quantiles: list[float], seed: int,
             batch_size: int, device) -> dict:
    """{"loss": mean over quantiles, "quantiles": {"0.1": loss, ...}}. Every rank must call it."""
    with layout_independent_threads(device) as side_by_side:
        return _evaluate(module, dataset, indices, quantiles, seed, batch_size, device, side_by_side)


def _evaluate(module, dataset, indices, quantiles, seed, batch_size, device, side_by_side: int = 1) -> dict:
    was_training = module.training
    module.eval()
    chunks = eval_chunks(dataset, indices, batch_size)
    world, me = world_size(), rank()
    position = {item: n for n, item in enumerate(indices)}
    per_item = torch.zeros(len(quantiles), len(indices), dtype=torch.float64)

    # on a CPU, where a pass at a small size reads the whole model for little compute, every quantile of a chunk goes
    # in one pass (the same rows wherever the chunk is computed); a device keeps its batch at the run's batch size
    quantile_groups = [list(range(len(quantiles)))] if torch.device(device).type == "cpu" else \
        [[qn] for qn in range(len(quantiles))]

    def forward_passes():
        """(chunk, the quantiles' indices, whether this rank's figures count, the chunk's batch at those quantiles,
        quantile by quantile), in one fixed order: the same number on every rank, because ZeRO-3 gathers weights
        collectively in each pass."""
        for r in range(-(-len(chunks) // world)):
            slot = r * world + me
            chunk = chunks[slot] if slot < len(chunks) else chunks[-1]
            latents, cond, pooled = dataset.batch(chunk)
            references = dataset.references(chunk) if getattr(dataset, "reference_slots", 0) else None
            text_mask = dataset.text_masks(chunk)
            text_extras = dataset.text_extras(chunk)
            noise = eval_noise(latents.shape[1:], chunk, seed)
            audio = dataset.audio_latents(chunk) if has_audio(dataset) else None
            audio_noise = eval_noise(audio.shape[1:], chunk, seed, EVAL_AUDIO_NOISE_STREAM) if audio is not None \
                else None
            for group in quantile_groups:
                def rows(x):
                    return repeated_rows(x, len(group), device)
                timesteps = torch.tensor([float(quantiles[qn]) for qn in group for _ in chunk], device=device)
                yield chunk, group, slot < len(chunks), Batch(
                    latents=rows(latents), cond=rows(cond), pooled=rows(pooled), noise=rows(noise),
                    timesteps=timesteps, references=rows(references), text_mask=rows(text_mask),
                    text_extras=rows(text_extras), audio=rows(audio), audio_noise=rows(audio_noise))

    def losses_of(batch):
        with torch.no_grad():  # grad mode is per thread
            return module.family.loss(batch, reduce=False, weighted=False).double().cpu()

    if side_by_side > 1 and world == 1 and passes_may_run_side_by_side(module):
        done = side_by_side_results(forward_passes(), losses_of, side_by_side)
    else:
        done = ((one, losses_of(one[-1])) for one in forward_passes())
    for (chunk, group, counts, _), losses in done:
        if counts:
            for qn, at_quantile in zip(group, losses.view(len(group), len(chunk))):
                for item, loss in zip(chunk, at_quantile):
                    per_item[qn, position[item]] = loss
    if world > 1:
        per_item = per_item.to(device)
        torch.distributed.all_reduce(per_item)
        per_item = per_item.cpu()
    module.train(was_training)
    return summarise(per_item, quantiles, len(indices))


def passes_may_run_side_by_side(module) -> bool:
    """Whether forward passes of `module` may run in threads at once: not where ZeRO-3 gathers and releases its
    weights around each module (DeepSpeed tracks which modules use a weight per process, not per thread), nor where
    block swap brings a block's weights in for the pass (memory.enable_block_swap swaps them in place)."""
    return not any(hasattr(p, "ds_id") or getattr(p, "host_resident", False) for p in module.parameters())


def side_by_side_results(passes, losses_of, workers: int):
    """(pass, its losses) in the passes' order, `workers` passes computing at a time, each on one thread: on a CPU
    one process's cores each run whole passes, so the numbers are those of one thread in order, in about
    1/workers of the time; at most `workers` batches are built ahead."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(workers, initializer=set_cpu_threads, initargs=(1,)) as pool:
        window = []
        for one in passes:
            window.append((one, pool.submit(losses_of, one[-1])))
            if len(window) == workers:
                yield from ((done, future.result()) for done, future in window)
                window = []
        yield from ((done, future.result()) for done, future in window)


def summarise(per_item: torch.Tensor, quantiles: list[float], items: int) -> dict:
    """Per-quantile means of the per-image losses (quantiles x images), in one fixed order."""
    per_quantile = {f"{q:g}": per_item[qn].mean().item() for qn, q in enumerate(quantiles)}
    return {"loss": sum(per_quantile.values()) / len(per_quantile), "quantiles": per_quantile, "items": items}


def run_evaluation(spec, events) -> dict:
    """The `evaluate` task: the loss of the model as given (adapters merged upstream) on a cached dataset."""
    import time

    from ..data.dataset_checks import check_dataset_for_family, check_text_extras_batching
    from ..comfy_env import import_comfy
    from ..data.loading import load_cached_dataset
    from ..parallel.distributed import init_distributed
    from ..training_module import TrainingModule
    from ..models import load_family
    from ..parallel.plain_engine import hold_in

    started = time.time()
    import_comfy()
    from ..parallel.memory_plan import refuse_unloadable
    refuse_unloadable(spec.model, spec.train.precision)
    family = load_family(spec.model, precision=spec.train.precision)
    family.set_objective(flow_shift=spec.train.flow_shift, guidance=spec.train.guidance)
    dataset = load_cached_dataset(spec.data.eval_manifest or spec.data.manifest)
    # the training check, before anything runs (the Evaluate node checked the graph's dataset already)
    where = "data.eval_manifest" if spec.data.eval_manifest else "data.manifest (the Evaluate node's dataset input)"
    check_dataset_for_family(dataset, family, where)
    check_text_extras_batching(dataset, spec.train.batch_size, where=where)
    family.read_dataset(dataset)
    if world_size() > 1:
        init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    from ..models import PRECISION_DTYPES
    dtype = getattr(torch, PRECISION_DTYPES[spec.train.precision])
    module = TrainingModule(family)
    hold_in(module, dtype, device)  # an fp8 base stays fp8 (a Module.to(dtype) made Flux fp8 a 24 GB model)
    family.diffusion_model.requires_grad_(False)
    events.emit("started", run_dir=spec.run_dir, total=0, start_step=0, world_size=world_size(), family=family.name,
                precision=spec.train.precision, device=device.type,
                base_weight_bytes=family.base_weight_bytes(),
                prediction=family.prediction, eval_items=min(spec.train.eval_items, len(dataset.unique)),
                task="evaluate")
    t = spec.train
    # the items a training run with this seed and eval_items evaluates on this dataset: the figures compare
    result = evaluate(module, dataset, eval_subset(dataset.unique, max(t.eval_items, 1), t.seed), t.eval_quantiles,
                      t.seed, t.batch_size, device)
    events.emit("eval", step=0, **result)
    events.emit("finished", adapter=None, steps=0, stopped=False, task="evaluate", evaluation=result,
                wall_s=time.time() - started)
    return result
