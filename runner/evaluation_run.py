"""The Evaluate node's work: the trainer program's `evaluate` task on the graph's MODEL and a cached dataset."""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

from ..trainer.spec import DistributedSpec, RunSpec, TrainSpec


def parse_quantiles(text: str, name: str = "quantiles", allow_empty: bool = False) -> list[float]:
    """'0.1, 0.5 0.9' → [0.1, 0.5, 0.9]; the error names the input (`name`) and the bad value. `allow_empty`: an
    empty text is [] (the Train node: no evaluation)."""
    values = []
    for part in text.replace(",", " ").split():
        try:
            q = float(part)
        except ValueError:
            raise ValueError(f"{name}: {part!r} is not a number") from None
        if not 0.0 < q < 1.0:
            raise ValueError(f"{name}: {part} is not between 0 and 1")
        values.append(q)
    if not values and not allow_empty:
        raise ValueError(f"{name}: give at least one value between 0 and 1, e.g. 0.1, 0.5, 0.9")
    return sorted(set(values))


def evaluate_model(model, dataset, *, train: TrainSpec, distributed: DistributedSpec | None,
                   on_event: Callable[[dict], None], check_interrupt: Callable[[], None], prompt: dict | None = None,
                   node_id: str = "", model_input: str = "model", remember: bool = False) -> dict:
    """{"loss", "quantiles": {"0.1": loss, ...}, "items"}: same inputs, same numbers, on any number of processes.

    `train` is the node's draft of the spec's train section: its batch size, precision, seed, eval_quantiles and
    eval_items (an evaluation takes one step).

    `prompt`, `node_id` and `model_input` (the node's hidden inputs and the name of the input `model` came in by)
    say where the MODEL comes from, so it reaches the trainer as files (runner.model_source). `remember`: a result
    of this server for the same files (their stamps), dataset and settings is given again without a run (the
    Evaluate node's baseline: the base model's numbers, asked again each time the trained model changes)."""
    from . import paths
    from .launcher import TrainerProcess
    from .model_source import hand_off_model, release_comfy_models
    from .session import RunDatasets, prepare_run, watch_run

    check_evaluation_references(model, dataset)
    train = dataclasses.replace(train, steps=1)
    release_comfy_models(model)  # the GPU goes to the trainer (and a fallback reads the weights unpatched)
    hand_off = hand_off_model(model, prompt, node_id, model_input, paths.models_root())
    d = distributed or DistributedSpec()
    key = _result_key(hand_off.model_spec, dataset, train, d) if remember else None
    if key in _remembered:
        return copy.deepcopy(_remembered[key])
    draft = RunSpec(task="evaluate", model=hand_off.model_spec, train=train, distributed=d)
    run_dir, spec_path = prepare_run(draft, runs_root=paths.evals_root(), name="eval", datasets=RunDatasets(dataset),
                                     cache_root=paths.cache_root())
    # prime_beside: a Train node after this Evaluate node (the shipped workflow's order) finds its standby warm
    process = TrainerProcess(run_dir, spec_path, comfyui_path=paths.comfyui_root(), processes=d.processes,
                             hostfile=d.hostfile, prime_beside=True).start()
    result = watch_run(process, on_event, check_interrupt).finished["evaluation"]
    if key is not None:
        _remembered[key] = copy.deepcopy(result)
        while len(_remembered) > REMEMBERED_RESULTS:
            del _remembered[next(iter(_remembered))]  # the oldest
    return result


REMEMBERED_RESULTS = 64
_remembered: dict[str, dict] = {}  # this server's remembered evaluations (evaluate_model's `remember`), by _result_key


def _result_key(model_spec, dataset, train: TrainSpec, distributed: DistributedSpec) -> str:
    """Everything an evaluation's numbers follow from: the model's files with their stamps (size and time: a file
    written again is another model), every cached item's keys and checksums, the settings."""
    import hashlib
    import json
    parts = [dataclasses.asdict(x) for x in (model_spec, dataset, train, distributed)]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def check_evaluation_references(model, dataset):
    """Refuses, before anything is handed off or launched, a dataset whose reference images the MODEL's family
    cannot take: training's rule (trainer.data.dataset_checks.check_dataset_for_family, which leaves the items' sizes to
    the trainer: the graph's dataset holds its bucket settings, not the sizes), naming the Evaluate node's input."""
    from ..trainer.data.dataset_checks import check_dataset_for_family
    from ..trainer.models import UnsupportedSetting, family_for
    family = family_for(model.model)
    try:
        check_dataset_for_family(dataset, family, "dataset")
    except UnsupportedSetting as exc:
        raise ValueError(f"Evaluate ({family.display_name} model): {exc}") from None


def quantile_table(results: dict[str, dict]) -> str:
    """Plain-text table: one row per quantile, one column per evaluated model, the mean last."""
    names = list(results)
    quantiles = list(next(iter(results.values()))["quantiles"])
    width = max(12, *(len(n) + 2 for n in names))
    lines = ["quantile".ljust(10) + "".join(n.rjust(width) for n in names)]
    for q in quantiles:
        lines.append(q.ljust(10) + "".join(f"{results[n]['quantiles'][q]:.6f}".rjust(width) for n in names))
    lines.append("mean".ljust(10) + "".join(f"{results[n]['loss']:.6f}".rjust(width) for n in names))
    return "\n".join(lines)
