"""Run safety (unit tier): hostfiles, output names, foreign files, spec values, non-finite events."""
from __future__ import annotations

import importlib
import json
import math
import os
import struct
import sys
import types
from pathlib import Path

import pytest

from conftest import REPO, requires_deepspeed  # noqa: E402  (conftest registers the pack as the package ingraph_trainer)

config = importlib.import_module("ingraph_trainer.trainer.spec")
events = importlib.import_module("ingraph_trainer.trainer.run.events")
hostfile = importlib.import_module("ingraph_trainer.trainer.parallel.hostfile")


def test_hostfile_grammar_and_errors_by_line_number(tmp_path, monkeypatch):
    monkeypatch.setenv(hostfile.ALLOWED_HOSTS_ENV, "worker-1, worker-2.lan a")
    good = tmp_path / "hosts"
    good.write_text("# cluster\nworker-1 slots=4\n\n  worker-2.lan slots=2  \n")
    assert hostfile.parse_hostfile(good) == [("worker-1", 4), ("worker-2.lan", 2)]
    for text, needle in [("worker-1 slots=4\nsecret-value-42\n", "line 2: expected 'hostname slots=N'"),
                         ("a slots=1\na slots=2\n", "line 2: host already listed on line 1"),
                         ("a slots=0\n", "line 1: slots must be at least 1"),
                         ("# nothing\n", "lists no hosts"),
                         # any client can give a hostfile: DeepSpeed would ssh to its hosts with the server's keys
                         ("localhost slots=1\nattacker.example slots=1\n",
                          f"line 2: not a machine the server's operator allows (this one, or one listed in "
                          f"{hostfile.ALLOWED_HOSTS_ENV})")]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(hostfile.HostfileError) as info:
            hostfile.parse_hostfile(bad)
        assert needle in str(info.value) and "secret-value-42" not in str(info.value)


def test_hostfile_of_the_process_environment_is_refused_without_echoing_it(monkeypatch):
    canary = "canary-7f3e9b1d"
    monkeypatch.setenv("INGRAPH_CANARY", canary)  # /proc/self/environ is read at open, so it is there
    problems = config.DistributedSpec(processes=1, hostfile="/proc/self/environ").problems()
    assert len(problems) == 1 and "distributed.hostfile" in problems[0] and "line 1" in problems[0]
    assert canary not in problems[0] and "INGRAPH" not in problems[0]
    assert config.DistributedSpec(hostfile="/nonexistent/hosts").problems()[0].endswith(
        "does not exist or is not a file")


def _spec_dict(**tables):
    import dataclasses
    spec = config.RunSpec(run_dir="/tmp/r")
    spec.model.path, spec.data.manifest, spec.output.lora_path = "/m.safetensors", "/d.json", "/l.safetensors"
    data = dataclasses.asdict(spec)
    for table, values in tables.items():
        data[table].update(values)
    return data


@pytest.mark.parametrize("table,values,needle", [
    ("train", {"learning_rate": math.nan}, "train.learning_rate: must be a finite number"),
    ("train", {"learning_rate": math.inf}, "train.learning_rate: must be a finite number"),
    ("train", {"weight_decay": -0.1}, "train.weight_decay: must be 0 or more"),
    ("train", {"max_grad_norm": -1.0}, "train.max_grad_norm"),
    ("train", {"seed": -3}, "train.seed: must be 0 or more"),
    ("train", {"eval_quantiles": "0.5"}, "train.eval_quantiles: expected list"),
    ("samples", {"prompts": "a cat"}, "samples.prompts: expected list"),
    ("samples", {"cfg": -1.0}, "samples.cfg: must be 0 or more"),
    ("adapter", {"alpha": math.inf}, "adapter.alpha: must be a finite number"),
])
def test_spec_refuses_wrong_types_non_finite_and_negative_values(table, values, needle):
    with pytest.raises(config.RunSpecError) as info:
        config.spec_from_dict(_spec_dict(**{table: values}))
    assert needle in str(info.value)


def test_spec_writer_escapes_control_characters(tmp_path):
    import tomllib
    spec = config.spec_from_dict(_spec_dict())
    spec.output.name = 'odd\tname\x00with\x1b"quotes"\\and\r\nlines\x7f'
    spec.samples.prompts = ["a\x0bb", "ünïcode ✓"]
    text = config.dump_run_spec(spec)
    back = tomllib.loads(text)
    assert back["output"]["name"] == spec.output.name and back["samples"]["prompts"] == spec.samples.prompts
    spec.train.learning_rate = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        config.dump_run_spec(spec)


def test_events_carry_non_finite_numbers_as_null(tmp_path):
    import torch
    writer = events.EventWriter(tmp_path / "events.jsonl")
    writer.emit("step", step=3, loss=math.nan, grad_norm=math.inf, lr=torch.tensor(0.5), extra={"x": [-math.inf]})
    writer.close()
    line = (tmp_path / "events.jsonl").read_text()
    event = json.loads(line)
    assert event["loss"] is None and event["grad_norm"] is None and event["lr"] == 0.5 and event["extra"]["x"] == [None]


@pytest.fixture
def loras_folder(tmp_path, monkeypatch):
    """A stand-in for ComfyUI's folder_paths with one models/loras folder."""
    folder = tmp_path / "loras"
    folder.mkdir()
    fake = types.ModuleType("folder_paths")
    fake.get_folder_paths = lambda name: [str(folder)]
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    return folder


@pytest.mark.parametrize("name,needle", [
    ("a:b", "':'"), ("what?", "'?'"), ("tab\there", "'\\t'"), ("CON", "reserved device name"),
    ("sub/aux.v2", "reserved device name"), ("trailing.", "ends with a space or a dot"), ("sub/ lead", "starts with"),
    ("é" * 120, "too long for a file name (258 bytes with its temporary name)"),
    ("x" * 201, "at most 200"), ("../up", "inside models/loras"), ("", "inside models/loras"),
])
def test_output_names_that_fail_somewhere_are_refused(loras_folder, name, needle):
    paths = importlib.import_module("ingraph_trainer.runner.paths")
    with pytest.raises(ValueError) as info:
        paths.lora_output_path(name)
    assert needle in str(info.value)


def test_output_name_never_passes_through_a_file(loras_folder):
    paths = importlib.import_module("ingraph_trainer.runner.paths")
    (loras_folder / "styles").write_bytes(b"not a folder")
    with pytest.raises(ValueError, match="styles is a file, not a folder"):
        paths.lora_output_path("styles/mine")
    (loras_folder / "taken.safetensors").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        paths.lora_output_path("taken")
    path, name = paths.lora_output_path("new/sub\\mine.safetensors")
    assert path == loras_folder / "new" / "sub" / "mine.safetensors" and name == "new/sub/mine.safetensors"
    assert paths.lora_output_path("é" * 110)[1] == "é" * 110 + ".safetensors"  # 238 bytes with its temporary name


def _safetensors_with_metadata(path: Path, metadata: dict | None):
    header = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    if metadata is not None:
        header["__metadata__"] = metadata
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0\0\0\0")


def test_only_files_with_the_packs_metadata_count_as_its_own(tmp_path, loras_folder):
    adapters = importlib.import_module("ingraph_trainer.trainer.adapters")
    ours, theirs, junk = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors", tmp_path / "junk.safetensors"
    _safetensors_with_metadata(ours, {"ingraph_trainer": "{}", "ss_network_dim": "4"})
    _safetensors_with_metadata(theirs, {"ss_network_dim": "4"})
    junk.write_bytes(os.urandom(64))
    assert adapters.written_by_pack(ours)
    assert not adapters.written_by_pack(theirs) and not adapters.written_by_pack(junk)
    assert not adapters.written_by_pack(tmp_path / "missing.safetensors")


def test_deeply_nested_planted_files_are_refused_not_crashed_on(tmp_path, monkeypatch):
    monkeypatch.setenv("INGRAPH_SECRET_FILE", str(tmp_path / "secret"))
    checkpoint = importlib.import_module("ingraph_trainer.trainer.run.checkpoint")
    runs = importlib.import_module("ingraph_trainer.runner.runs")
    run = tmp_path / "runs" / "20260101-000000-deep-aaaa"
    tag = run / "checkpoints" / "step_000001"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text("[" * 100_000 + "]" * 100_000)
    (tag / "trainer_state.json").write_text("{}")
    (run / "run.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000)
    assert checkpoint.complete_checkpoints(run) == []
    assert runs.find_latest_resumable(tmp_path / "runs", "deep") is None
    with pytest.raises(config.RunSpecError, match="nested too deeply|not valid TOML"):
        config.load_run_spec(run / "run.toml")


def test_checkpoints_past_a_million_steps_sort_by_step(tmp_path, monkeypatch):
    checkpoint = importlib.import_module("ingraph_trainer.trainer.run.checkpoint")
    paths = [tmp_path / checkpoint.tag_for(step) for step in (999_000, 1_000_000, 20)]
    assert [p.name for p in sorted(paths, key=checkpoint._step_of)] == ["step_000020", "step_999000", "step_1000000"]


@requires_deepspeed
def test_a_module_planted_in_the_run_folder_is_never_imported(tmp_path):
    """The run folder is under output/ (any client writes there); `python -m deepspeed...` would import a
    planted deepspeed/ package from its working folder, and DeepSpeed reads ./.deepspeed_env."""
    launcher = importlib.import_module("ingraph_trainer.runner.launcher")
    marker = tmp_path / "imported"
    run_dir = tmp_path / "run"
    (run_dir / "deepspeed").mkdir(parents=True)
    (run_dir / "deepspeed" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('planted')\n")
    (run_dir / "run.toml").write_text("version = 1\n")  # unsigned: the trainer refuses it
    process = launcher.TrainerProcess(run_dir, run_dir / "run.toml", processes=2, watch_parent=False).start()
    try:
        assert process.proc.wait(timeout=180) != 0
    finally:
        process.terminate()
    assert "not the run this installation signed" in (run_dir / "trainer.log").read_text()  # the trainer ran
    assert not marker.exists()


def test_a_refused_spec_leaves_no_half_written_run_folder(tmp_path):
    """prepare_run writes manifests before the spec is validated: a refusal (here an optimizer the layout cannot
    honour) removes the folder it made, so no half-written run is offered for resume."""
    import types
    from ingraph_trainer.runner.session import RunDatasets, prepare_run
    from ingraph_trainer.trainer.spec import ModelSpec, RunSpec, RunSpecError, TrainSpec
    dataset = types.SimpleNamespace(cache_keys=lambda: [], folder=str(tmp_path), repeats=1, items=[], empty_text=None,
                                    caption_dropout=0.0)
    runs = tmp_path / "runs"
    runs.mkdir()
    draft = RunSpec(model=ModelSpec(path=str(tmp_path / "m.safetensors")),
                    train=TrainSpec(optimizer="adamw_schedulefree", precision="bf16"))
    with pytest.raises(RunSpecError, match="train.optimizer"):
        prepare_run(draft, runs_root=runs, name="refused", datasets=RunDatasets(dataset),
                    cache_root=tmp_path / "cache", lora_path=tmp_path / "out.safetensors")
    assert list(runs.iterdir()) == []
    kept = tmp_path / "mine"  # a folder the caller made is left as it was
    kept.mkdir()
    (kept / "notes.txt").write_text("keep")
    with pytest.raises(RunSpecError):
        prepare_run(draft, runs_root=runs, name="refused", datasets=RunDatasets(dataset),
                    cache_root=tmp_path / "cache", lora_path=tmp_path / "out.safetensors", run_dir=kept)
    assert (kept / "notes.txt").read_text() == "keep"


def test_dataset_folders_come_from_input_or_the_operators_roots(tmp_path, monkeypatch):
    """The rule behind Load Training Images' folder inputs: input/ and its sub-folders, plus INGRAPH_DATASET_ROOTS;
    '..' cannot climb out; a relative folder is input/'s."""
    paths = importlib.import_module("ingraph_trainer.runner.paths")
    inputs, allowed, other = (tmp_path / name for name in ("input", "datasets", "elsewhere"))
    monkeypatch.setitem(sys.modules, "folder_paths", types.SimpleNamespace(get_input_directory=lambda: str(inputs)))
    monkeypatch.delenv(paths.DATASET_ROOTS_ENV, raising=False)
    assert paths.resolve_input_folder("cats") == inputs / "cats"
    assert paths.resolve_input_folder(f"  {inputs / 'dogs'} ") == inputs / "dogs"
    for refused in ("../elsewhere", str(other), str(allowed / "set"), "cats/../../elsewhere"):
        with pytest.raises(ValueError, match=r"reference_folder '.*' is outside ComfyUI's input folder.*"
                                             + paths.DATASET_ROOTS_ENV):
            paths.resolve_input_folder(refused, "reference_folder")
    monkeypatch.setenv(paths.DATASET_ROOTS_ENV, os.pathsep.join([str(allowed), str(tmp_path / "more")]))
    assert paths.resolve_input_folder(str(allowed / "set")) == allowed / "set"
    with pytest.raises(ValueError, match="outside"):
        paths.resolve_input_folder(str(other))
