"""What the runner does for the Evaluate node beyond any run (runner.node_run.run_task with the trainer program's
`evaluate` task): its refusals, its remembered results, the quantiles input and the table of results."""
from __future__ import annotations

import copy
import dataclasses

from ..trainer.spec import RunSpec
from .train_run import check_dataset_for_model


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


def check_new_evaluation(draft: RunSpec, model, datasets, node) -> None:
    """An evaluation's refusals before its MODEL is handed off (runner.node_run.TASK_RUNS): a dataset the MODEL's
    family cannot take (train_run.check_dataset_for_model)."""
    check_dataset_for_model(model, datasets.train, node.title)


REMEMBERED_RESULTS = 64
_remembered: dict[str, object] = {}  # this server's remembered evaluations (run_task's `remember`), by _result_key


def remembered_result(draft: RunSpec, datasets):
    """The RunResult this server remembers for an evaluation of the same draft (its model's files with their stamps,
    its settings) on the same datasets, or None: an Evaluate node's baseline, the base model's numbers, asked again
    each time the trained model changes."""
    found = _remembered.get(_result_key(draft, datasets))
    return copy.deepcopy(found) if found is not None else None


def remember_result(draft: RunSpec, datasets, result) -> None:
    """Remembers a copy of an evaluation's RunResult (the caller keeps its own), the oldest forgotten past
    REMEMBERED_RESULTS."""
    _remembered[_result_key(draft, datasets)] = copy.deepcopy(result)
    while len(_remembered) > REMEMBERED_RESULTS:
        del _remembered[next(iter(_remembered))]  # the oldest


def _result_key(draft: RunSpec, datasets) -> str:
    """Everything an evaluation's numbers follow from: the model's files with their stamps (size and time: a file
    written again is another model), every cached item's keys and checksums, the settings."""
    import hashlib
    import json
    parts = [dataclasses.asdict(x) for x in (draft.model, datasets.train, draft.train, draft.distributed)]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


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
