"""Unit tests (no server, no trainer launch) of the trainer's shape: the atomic writer, the layout interface,
the choices table, the host-sync cadence."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

import conftest  # noqa: F401  (registers the pack as the ingraph_trainer package)
from conftest import requires_deepspeed


def test_atomic_write_leaves_the_old_file_on_failure_and_no_temporary(tmp_path):
    from ingraph_trainer.cache.files import atomic_write, atomic_write_text
    target = tmp_path / "manifest.json"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_write(target) as staged:
            staged.path.write_text("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert oct(target.stat().st_mode & 0o777) == "0o644"


def test_concurrent_writers_of_one_file_never_share_a_temporary(tmp_path):
    """The manifest writer used a fixed `<name>.tmp`: two writers could rename each other's half-written file."""
    from ingraph_trainer.cache.files import atomic_write
    target = tmp_path / "dataset.json"
    inside = threading.Barrier(2)
    temporaries = []

    def write(text):
        with atomic_write(target) as staged:
            temporaries.append(staged.path)
            staged.path.write_text(text)
            inside.wait(5)  # both are between writing and renaming
    threads = [threading.Thread(target=write, args=(text * 1000,)) for text in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(temporaries)) == 2
    assert target.read_text() in ("a" * 1000, "b" * 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset.json"]


def test_discarded_staging_leaves_the_target_alone(tmp_path):
    from ingraph_trainer.cache.files import atomic_write
    target = tmp_path / "shard.safetensors"
    with atomic_write(target, prefix=".0123456789ab-") as staged:
        assert staged.path.name.startswith(".0123456789ab-") and staged.path.name.endswith(".partial")
        staged.path.write_bytes(b"x")
        staged.discard()
    assert list(tmp_path.iterdir()) == []


def test_manifest_writes_go_through_the_atomic_writer(tmp_path, monkeypatch):
    from ingraph_trainer.cache import store
    written = []
    monkeypatch.setattr(store, "atomic_write_text", lambda path, text: written.append(Path(path)) or Path(path))

    class Dataset:
        folder, repeats, items, empty_text = "f", 1, [], None

        def cache_keys(self):
            return []
    monkeypatch.setattr(store.CacheStore, "pin_manifest", lambda self, path, keys: None)
    store.write_manifest(tmp_path / "dataset.json", Dataset(), tmp_path / "cache")
    assert written == [tmp_path / "dataset.json"]


def test_each_choice_is_defined_once_with_the_labels_saved_workflows_hold():
    from ingraph_trainer.trainer import spec as config, export, objectives
    # saved workflows store these labels by position: they may grow, never change
    assert config.choice_labels(config.OPTIMIZER_CHOICES)[:2] == ["AdamW", "AdamW 8-bit"]
    assert config.choice_labels(config.ADAPTER_FORMAT_CHOICES) == ["ComfyUI", "kohya (lora_unet_*)", "diffusers (peft)"]
    assert config.choice_labels(config.SCHEDULE_CHOICES) == ["constant", "linear decay", "cosine decay"]
    assert config.choice_labels(config.TIMESTEP_SAMPLING_CHOICES) == ["uniform", "logit-normal"]
    assert config.choice_labels(config.LOSS_CHOICES) == ["MSE", "Huber"]
    assert config.choice_labels(config.ADAPTER_KIND_CHOICES) == ["LoRA", "LoHa", "LoKr", "DoRA", "Full fine-tune"]
    assert config.choice_labels(config.TARGET_CHOICES) == ["attention", "attention + feed-forward", "all linear layers",
                                                           "all linear and convolution layers"]
    assert config.ADAPTER_FORMATS == ("comfyui", "kohya", "diffusers") and objectives.LOSSES is config.LOSSES
    assert not hasattr(export, "FORMATS")
    assert config.choice_value(config.SCHEDULE_CHOICES, "linear decay", "lr_schedule") == "linear"
    assert config.choice_value(config.SCHEDULE_CHOICES, "cosine", "lr_schedule") == "cosine"
    with pytest.raises(ValueError, match=r"lr_schedule: 'step' is not one of \['constant', 'linear decay'"):
        config.choice_value(config.SCHEDULE_CHOICES, "step", "lr_schedule")
    assert "AdamW 8-bit: bitsandbytes" in config.choices_tooltip(config.OPTIMIZER_CHOICES)
    for name in dir(config):
        if name.endswith("_CHOICES"):
            choices = getattr(config, name)
            assert all(c.tooltip for c in choices) and len({c.value for c in choices}) == len(choices), name


PACK_LAYERS = {"nodes": 3, "runner": 2, "trainer": 1, "cache": 1, "client": 1}  # an import goes down or sideways


def _pack_import_graph() -> dict[str, set[str]]:
    """Each module of the pack's layers ("trainer.run.trust") and the pack modules it imports (relatively, or by
    its package name ingraph_trainer), lazy imports included, type checkers' alone not."""
    import ast
    graph = {}
    for folder in PACK_LAYERS:
        for path in (conftest.REPO / folder).rglob("*.py"):
            module = path.relative_to(conftest.REPO).with_suffix("").as_posix().replace("/", ".")
            package = module.rsplit(".", 1)[0]
            edges, tree = set(), ast.parse(path.read_text(encoding="utf-8"))
            for_types_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                              and getattr(block.test, "id", "") == "TYPE_CHECKING"
                              for statement in block.body for n in ast.walk(statement)}
            for node in ast.walk(tree):
                if id(node) in for_types_only:
                    continue
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                    names = [target] if node.module else [".".join([*base, a.name]) for a in node.names]
                elif isinstance(node, (ast.Import, ast.ImportFrom)):  # the pack by its package name
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    names = [n.removeprefix("ingraph_trainer.") for n in names if n.startswith("ingraph_trainer.")]
                else:
                    continue
                edges |= {n.replace(".__init__", "") for n in names if n}
            graph[module.replace(".__init__", "")] = edges
    return graph


def test_no_file_in_the_trainer_the_runner_or_the_cache_is_over_400_lines():
    """Issue 33: a file over 400 lines holds several concepts; split it along them."""
    long = {str(path.relative_to(conftest.REPO)): n for folder in ("trainer", "runner", "cache")
            for path in (conftest.REPO / folder).rglob("*.py")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > 400}
    assert not long, long


def test_no_import_cycle_in_the_pack_and_no_import_back_up_a_layer():
    """Lazy imports count too: loop, evaluation and pipeline used to import each other in a circle. The layers are
    nodes → runner → trainer and cache (which read each other's files: sideways); the API client stands alone."""
    graph = _pack_import_graph()
    assert len(graph) > 100 and "trainer.graph_model" in graph["runner.node_run"]  # the modules read are the pack's
    state: dict[str, int] = {}

    def known(name):  # "trainer.models.family_for" is an attribute of the module trainer.models
        return name if name in graph else name.rsplit(".", 1)[0]

    def visit(node, trail):
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(node):] + [node]))
        if state.get(node) == 2 or node not in graph:
            return
        state[node] = 1
        for nxt in graph[node]:
            visit(known(nxt), trail + [node])
        state[node] = 2
    for node in graph:
        visit(node, [])
    assert "trainer.parallel.layouts" in graph["trainer.tasks.loop"]
    assert "trainer.tasks.loop" not in graph["trainer.tasks.evaluation"]
    up = sorted(f"{module} -> {known(target)}" for module, targets in graph.items() for target in targets
                if PACK_LAYERS.get(target.split(".")[0], 0) > PACK_LAYERS[module.split(".")[0]]
                or (module.split(".")[0] == "client") != (target.split(".")[0] == "client"))
    assert not up, up


def test_the_training_loop_fits_on_one_screen_and_is_written_once():
    """One loop skeleton, in the task base: the trainer and the distiller differ in their hooks only."""
    import inspect
    from ingraph_trainer.trainer.tasks.base import TrainingTask
    from ingraph_trainer.trainer.tasks.distill import Distiller
    from ingraph_trainer.trainer.tasks.loop import Trainer
    assert len(inspect.getsource(TrainingTask.train).splitlines()) <= 50
    assert Trainer.train is Distiller.train is TrainingTask.train
    for task in (Trainer, Distiller):
        assert all(getattr(task, hook) is not getattr(TrainingTask, hook)
                   for hook in ("announce", "step", "report_step", "finish")), task


def test_parameter_norm_cadence():
    from ingraph_trainer.trainer.metrics import PARAM_NORM_EVERY, param_norm_due
    due = [s for s in range(1, 36) if param_norm_due(s, first=1, last=35)]
    assert due == [1, *range(PARAM_NORM_EVERY, 35, PARAM_NORM_EVERY), 35]
    assert param_norm_due(21, first=21, last=40)  # a resumed run reports it on its first step


def test_checkpoints_are_due_every_save_every_and_on_stop_never_on_the_last_step():
    from ingraph_trainer.trainer.run.checkpoint import Checkpointer
    every3 = Checkpointer(None, "run", save_every=3, keep_last=0, is_rank0=True)
    assert [s for s in range(1, 10) if every3.due(s, 9, False)] == [3, 6]
    assert every3.due(4, 9, True) and not every3.due(9, 9, True)
    assert not Checkpointer(None, "run", 0, 0, True).due(5, 9, False)


class _Engine:
    """DeepSpeed's engine as WholeModel drives it, counting what the step reads back from the device."""

    def __init__(self, losses, reported=None):
        import torch
        self.losses, self.reported, self.device = iter(losses), reported, torch.device("cpu")
        self.calls = 0

    def __call__(self, latents, cond, noise, timesteps, pooled):
        import torch
        self.param.grad = torch.full_like(self.param, 2.0)
        return torch.tensor(next(self.losses), dtype=torch.float32)

    def backward(self, loss):
        pass

    def is_gradient_accumulation_boundary(self):
        self.calls += 1
        return self.calls % 2 == 0

    def step(self):
        pass

    def get_global_grad_norm(self):
        return self.reported


def test_whole_model_step_reads_the_loss_once_and_means_it_like_the_old_loop(monkeypatch):
    import torch
    from ingraph_trainer.trainer.parallel import layouts, plain_engine
    layout = object.__new__(layouts.WholeModel)
    param = torch.nn.Parameter(torch.zeros(4))
    layout.trainable, layout._own_grad_norm = [param], True
    layout.engine = _Engine([0.3, 0.7000001])
    layout.engine.param = param
    expected = (torch.tensor(0.3).item() + torch.tensor(0.7000001).item()) / 2  # the old per-micro-batch .item()
    items = []
    original_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: items.append(1) or original_item(self))
    batch = (torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), None)
    loss, grad_norm = layout.train_step([batch, batch])
    assert loss == expected and grad_norm == pytest.approx(4.0)
    assert len(items) == 1  # the gradient norm's; the losses come back in one transfer
    layout.engine = _Engine([0.5, 0.5], reported=1.5)
    layout.engine.param = param
    assert layout.train_step([batch, batch])[1] == 1.5 and layout._own_grad_norm is False


@requires_deepspeed
def test_the_layouts_gradient_clipping_is_deepspeeds_bit_for_bit(monkeypatch):
    """WholeModel clips on DeepSpeed's fp32 path itself (one pass for the reported norm and the clip), and in one
    process leaves the engine's gradient all-reduce out: the weights must stay those of the engine's own
    all-reduce and clipping, bit for bit, and the reported norm that of grad_norm."""
    import torch
    from deepspeed.runtime import utils as deepspeed_utils
    from ingraph_trainer.trainer.parallel import layouts, plain_engine
    # one process: DeepSpeed's all-reduce of the norm is the identity, and needs no process group here
    monkeypatch.setattr(deepspeed_utils.dist, "all_reduce", lambda *args, **kwargs: None)
    monkeypatch.setattr(deepspeed_utils.dist, "get_world_size", lambda *args, **kwargs: 1)
    monkeypatch.setattr(deepspeed_utils.groups, "_get_data_parallel_group", lambda: None)
    unused = 9  # a trained parameter the step gives no gradient (a layer the family never runs)

    def module_with_gradients():
        torch.manual_seed(2)  # gradients whose clip coefficient depends on the order of the norms' sum
        module = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(24)))
        module[3].requires_grad_(False)
        for n, p in enumerate(module.parameters()):
            if p.requires_grad and n != unused:
                p.grad = torch.randn_like(p) * (1 + n % 5)
        return module

    def engine_all_reduce(module):  # what the engine's all-reduce does to a gradient left None
        for p in module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    for max_norm in (0.5, 1e9):  # clipping that bites, and one that multiplies by 1.0
        theirs, ours = module_with_gradients(), module_with_gradients()
        engine_all_reduce(theirs)
        trainable = [p for p in ours.parameters() if p.requires_grad]
        trainable = trainable[1:] + trainable[:1]  # reported in another order than the module's
        theirs_trainable = [p for p in theirs.parameters() if p.requires_grad]
        expected_norm = layouts.grad_norm(theirs_trainable[1:] + theirs_trainable[:1])
        norms = torch.stack([p.grad.float().norm(2.0) for p in theirs_trainable])
        assert (norms ** 2).sum() != (norms.roll(-1) ** 2).sum()  # so summing in the reported order fails
        deepspeed_utils.clip_grad_norm_(theirs.parameters(), max_norm)
        clipping = plain_engine.GradientClipping(max_norm)
        clipping.order(ours, trainable)
        reported = clipping.clip()
        assert torch.equal(reported, expected_norm)
        pairs = list(zip(theirs.parameters(), ours.parameters(), strict=True))
        assert len(pairs) == 48 and sum(p.grad is not None for _, p in pairs) == 46
        assert torch.equal(list(ours.parameters())[unused].grad, torch.zeros(6))
        for a, b in pairs:
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
        if max_norm < 1:
            assert float(reported) > 10 * max_norm  # the clip did bite


@pytest.mark.comfyui
def test_bootstrap_keeps_comfyuis_nodes_module_ahead_of_the_packs_nodes_package(monkeypatch):
    """ComfyUI's modules `import nodes` (its nodes.py); the pack's `nodes/` package has the same name. An
    in-process test puts the repo first and bootstraps again after another test already had: ComfyUI's folder
    must still lead, and appear once (tools bootstrap once per file they write)."""
    import importlib.machinery
    import sys
    from tools.bootstrap import REPO, bootstrap
    from tools.comfy_server import comfyui_path
    monkeypatch.setattr(sys, "path", list(sys.path))
    bootstrap()
    sys.path.insert(0, str(REPO))
    bootstrap()
    found = importlib.machinery.PathFinder.find_spec("nodes", sys.path)
    assert found is not None and Path(found.origin) == comfyui_path() / "nodes.py", found
    assert sys.path.count(str(comfyui_path())) == 1


def test_comfyui_is_called_through_comfy_compat_alone():
    """The next ComfyUI change is fixed in one module: outside trainer/comfy_compat.py (and comfy_env.py, which puts
    ComfyUI on the path), only the family files of trainer/models/ import comfy.* (they build ComfyUI's own model
    classes, one file per family); the nodes use comfy_api, ComfyUI's versioned node interface."""
    import ast
    root = Path(conftest.REPO)
    allowed = {"trainer/comfy_compat.py", "trainer/comfy_env.py"}
    found = []
    for folder in ("nodes", "runner", "cache", "trainer", "client"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in allowed or rel.startswith("trainer/models/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                found += [f"{rel}:{node.lineno} {n}" for n in names if n == "comfy" or n.startswith("comfy.")]
    assert not found, found
    assert (root / "trainer" / "models" / "__init__.py").is_file()  # the exemption names a real folder


def test_the_runner_asks_about_the_graphs_model_through_one_trainer_side_view():
    """Issue 33: the node's MODEL crosses into the trainer's side once. run_task reads its `model` once, to build
    trainer.graph_model.GraphModel, and the runner asks that view for the objective, the family, the patches, the
    release, the weights and the result applied; no runner module takes those from the trainer by another route,
    so the MODEL never comes back up to the runner to be passed down again."""
    import ast
    root = Path(conftest.REPO) / "runner"
    tree = ast.parse((root / "node_run.py").read_text(encoding="utf-8"))
    run_task = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "run_task")
    assert run_task.args.args[1].arg == "model"
    reads = [n for n in ast.walk(run_task) if isinstance(n, ast.Name) and n.id == "model"]
    calls = [n for n in ast.walk(run_task) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "GraphModel"]
    assert len(reads) == 1 and [c.args[0] for c in calls] == reads, [n.lineno for n in reads]
    asked_of_the_view = {"family_for", "prediction_from_sampling", "detect_prediction", "with_lora", "patched_weight",
                         "unload_all_models", "loaded_models", "config_metadata", "comfyui_readable"}
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                found += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name in asked_of_the_view]
            if isinstance(node, ast.Attribute) and node.attr in ("diffusion_model", "get_model_object",
                                                                  "unpatch_model", "add_patches", "patcher"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    # the one way out: the MODEL with the result applied, the node's output
    output = [n.lineno for n in ast.walk(run_task) if isinstance(n, ast.Attribute) and n.attr == "patcher"]
    assert len(output) == 1 and found == [f"node_run.py:{output[0]} .patcher"], found


def test_no_test_module_imports_another_and_each_is_in_its_tier():
    """What test modules share lives in conftest.py or tests/helpers/ (graph builders, media files, the programs
    the tests launch), so a test file can move or go without breaking another, and no test runs another file's
    test. Each test module is in its tier's folder: unit/ (in-process), trainer/ (the trainer program launched),
    comfyui/ (a ComfyUI server)."""
    import ast
    tests = Path(conftest.REPO) / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0].startswith("test_")]
    modules = list(tests.rglob("test_*.py"))
    assert len(modules) > 40  # the folders read are the suite's
    assert not found, found
    assert {p.parent.name for p in modules} == {"unit", "trainer", "comfyui"}, sorted(map(str, modules))


@pytest.mark.comfyui
def test_the_coverage_tool_builds_every_family_files_model():
    """tools/family_coverage.py reaches each family file that can build a model (a new family file is in the
    coverage table without an edit there), and sorts ComfyUI's classes as its README paragraph says."""
    sys.path.insert(0, str(conftest.REPO))
    from tools import family_coverage
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.models import FAMILIES
    from ingraph_trainer.trainer.models.base import ModelFamily
    labels = [label for label, _ in family_coverage.builders()]
    builds = [c.name for c in FAMILIES if c.scratch_state_dict.__func__ is not ModelFamily.scratch_state_dict.__func__]
    assert len(builds) >= 9 and set(builds) <= set(labels) and "sd_unet (embedded SD1.5)" in labels
    assert all(cls in {c.__name__ for c in FAMILIES} for cls, _ in family_coverage.VARIANTS.values())
    lumina = type("Lumina2", (), {"latent_format": type("Flux", (), {"latent_dimensions": 2})})
    wan = type("WAN21_T2V", (), {"latent_format": type("Wan21", (), {"latent_dimensions": 3})})
    qwen = type("QwenImage", (), {"latent_format": wan.latent_format})
    audio = type("StableAudio", (), {"latent_format": type("StableAudio1", (), {"latent_dimensions": 1})})
    assert [family_coverage.kind_of(c) for c in (lumina, wan, qwen, audio)] == ["image", "video", "image", "audio"]


def test_the_readmes_coverage_sections_are_the_coverage_runs():
    """Issue 34: the README's coverage section for each ComfyUI is what tools/family_coverage.py --readme wrote
    from the run whose full table is in docs/: the same classes trained, each built by a family file; and every
    family file that builds a model trains some ComfyUI class on one of the two ComfyUIs."""
    import re
    from tools.family_coverage import README_BEGIN, README_END
    readme = (conftest.REPO / "README.md").read_text(encoding="utf-8")
    families = set()
    for version, table in (("0.3.64", "coverage-comfyui-0.3.64.md"), ("0.33.0", "coverage-comfyui-0.33.md")):
        begin, end = README_BEGIN.format(version=version), README_END.format(version=version)
        assert begin in readme and end in readme, version
        section = readme.split(begin, 1)[1].split(end, 1)[0]
        rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
        full = (conftest.REPO / "docs" / table).read_text(encoding="utf-8")
        table_rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in full.splitlines()
                      if line.startswith("| ") and "---" not in line]
        steps = table_rows[0].index("2 LoRA steps (trainer program)")  # later columns: s/step, the LoRA check's
        trained = {cells[0] for cells in table_rows[1:] if cells[steps] == "yes"}
        assert {row[0].strip("| ") for row in rows} == trained and trained, version
        assert f"[docs/{table}](docs/{table})" in section
        summary = re.search(r"\*\*(ComfyUI [^*]+)\*\*", section).group(1)
        assert full.startswith(summary), (version, summary)  # the count line of the same run
        families |= {row[2].strip() for row in rows}
    sys.path.insert(0, str(conftest.REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.models import FAMILIES
    from ingraph_trainer.trainer.models.base import ModelFamily
    builds = {c.name for c in FAMILIES if c.scratch_state_dict.__func__ is not ModelFamily.scratch_state_dict.__func__}
    assert builds <= families, builds - families



@pytest.mark.comfyui
def test_a_hand_written_spec_names_any_family_of_the_registry():
    """model.family's names are the family registry's (trainer/models FAMILIES): a spec naming any of them is
    accepted, by the spec's rules and by the trainer's family lookup, and another name is refused naming the field
    (a second list of names once lacked five families)."""
    sys.path.insert(0, str(conftest.REPO))
    from tools.prepare_run import _bootstrap
    _bootstrap()
    from ingraph_trainer.trainer.models import FAMILIES, check_family_name
    from ingraph_trainer.trainer.spec import ModelSpec, RunSpec, dump_run_spec, parse_run_spec
    assert len(FAMILIES) >= 15
    for cls in FAMILIES:
        spec = RunSpec(run_dir="run", model=ModelSpec(path="model.safetensors", family=cls.name))
        spec.data.manifest, spec.output.lora_path = "dataset.json", "out.safetensors"
        written = parse_run_spec(dump_run_spec(spec).encode(), "hand-written")
        assert written.validate().model.family == cls.name
        check_family_name(cls.name)
    with pytest.raises(ValueError, match=r"^model\.family: 'chromaa' is not one of auto, "):
        check_family_name("chromaa")
