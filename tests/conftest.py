"""Test tiers: unit (always), trainer program and ComfyUI server (need COMFYUI_PATH).

Where ComfyUI is absent, every test that needs it is skipped and one line says so.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# the helpers the test modules share (graph builders, media files) and the programs the tests launch
sys.path.insert(1, str(REPO / "tests" / "helpers"))
# on a GPU machine: torch.cuda.is_available() in a parent (this session, tests/helpers/train_forked.py's server) would start
# CUDA and leave every child it forks unable to use the GPU ("Cannot re-initialize CUDA in forked subprocess", seen
# on an H100); asked through NVML it starts nothing. Set here, every process the suite starts inherits it.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# The suite runs several torch processes at once (the server, a run, the next run's standby warming, this session)
# on a few cores. OpenMP's default wait spins a waiting thread for a while, burning the core another process's
# thread needs; waiting asleep, a tiny SDXL run's one-step preview beside a warming standby took 0.6 s, not 3.6 s,
# and the ComfyUI 0.33 tier 386 s, not 421 s (2 cores). The numbers are the same: only how an idle thread waits.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tools.comfy_server import ComfyServer, comfyui_available, comfyui_path  # noqa: E402

if "ingraph_trainer" not in sys.modules:  # the pack as a package, as ComfyUI and the trainer see it
    import types
    _pkg = types.ModuleType("ingraph_trainer")
    _pkg.__path__ = [str(REPO)]
    sys.modules["ingraph_trainer"] = _pkg

COMFYUI_MISSING = f"skipped: ComfyUI not found at {comfyui_path()} (set COMFYUI_PATH)"
from ingraph_trainer.trainer.comfy_compat import comfyui_version  # noqa: E402
# the ComfyUI under test is 0.33 or later (scripts/test.sh's second tier); () where none is found
ON_COMFYUI_033 = comfyui_version(comfyui_path()) >= (0, 33)
# scripts/test.sh runs the ComfyUI 0.33 tier after this run: the graph tests kept to 0.33 for suite time
# (on_033_tier_alone) run there alone; without that tier to follow (INGRAPH_SKIP_033=1, no 0.33, pytest run by hand)
# they run on this ComfyUI
THE_033_TIER_FOLLOWS = os.environ.get("INGRAPH_033_TIER_FOLLOWS") == "1"


def on_033_tier_alone(what: str):
    """A test that runs on the 0.33 tier alone where that tier follows this run (suite time), else here."""
    return pytest.mark.skipif(not ON_COMFYUI_033 and THE_033_TIER_FOLLOWS,
                              reason=f"skipped: {what} on the ComfyUI 0.33 tier that follows, what users run today "
                                     "(suite time)")
from ingraph_trainer.trainer.spec import deepspeed_installed  # noqa: E402
# the tests of what only DeepSpeed does (several processes, ZeRO, pipelines): a one-GPU install has no DeepSpeed
requires_deepspeed = pytest.mark.skipif(not deepspeed_installed(), reason="skipped: DeepSpeed is not installed "
                                        "(the multi-GPU extra, requirements-multi-gpu.txt)")
ARTIFACTS = Path(os.environ.get("INGRAPH_TEST_ARTIFACTS", REPO / "test-artifacts"))
CHECKPOINT_NAME = "ingraph_tiny_sd15.safetensors"
# in the test server's environment: nothing a client can read may ever carry it (tests/comfyui/test_run_control.py)
ENV_CANARY = "ingraph-canary-" + os.urandom(8).hex()
IMAGE_FOLDER = "ingraph_example"
ONE_IMAGE_FOLDER = "ingraph_one"  # the first example image and its caption: evaluation where it is not the point
SUITE_EVAL_QUANTILES = "0.5"  # the Train node's eval_quantiles where evaluation is not the point (suite time)
SKIP_DISTILL_QUALITY = os.environ.get("INGRAPH_SKIP_DISTILL_QUALITY") == "1"  # ~3.5 min of one core left out


def pytest_report_header(config):
    return f"ComfyUI: {comfyui_path()}" if comfyui_available() else COMFYUI_MISSING


def pytest_collection_modifyitems(config, items):
    # the tests on a background run's result last (the distillation quality check's figures, pip's resolution of a
    # plain install), so the run (pytest_collection_finish) has the whole suite's idle core time to finish in; the
    # rest by file name across the tier folders (the order the suite's timing was tuned in: the tiny models build
    # in the background while the first files run)
    items.sort(key=lambda item: (_needs_background_run(item), item.path.name))
    if comfyui_available():
        return
    skip = pytest.mark.skip(reason=COMFYUI_MISSING)
    for item in items:
        if "comfyui" in item.keywords:
            item.add_marker(skip)


def _needs_distill_quality(item) -> bool:
    return "distill_quality_figures" in getattr(item, "fixturenames", ())


def _needs_plain_install(item) -> bool:
    return "plain_install_report" in getattr(item, "fixturenames", ())


def _needs_background_run(item) -> bool:
    return _needs_distill_quality(item) or _needs_plain_install(item)


def _set_autogroup_nice(pid: int | str, nice: int):
    try:
        with open(f"/proc/{pid}/autogroup", "w") as autogroup:  # absent where autogroup scheduling is off
            autogroup.write(str(nice))
    except OSError:
        pass


def _lowest_priority():
    """In a child just made a session leader (start_new_session): its autogroup and itself at nice 19, and killed
    with the test session however that ends (a cancelled CI job does not run pytest_sessionfinish)."""
    _set_autogroup_nice("self", 19)
    os.nice(19)
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


class BackgroundRun:
    """A tool started as soon as the session knows a selected test needs what it makes, at the lowest CPU priority:
    it runs on the core time the other tests leave idle (process starts, servers' waits, one-thread work) and
    barely slows them, and what it makes is the same (seeded, one thread). Linux's autogroup scheduling shares the
    CPU between sessions first (the server and each trainer have their own) and only then by nice value within one:
    so it runs in a session of its own whose autogroup is at nice 19. One thread: more would oversubscribe the
    cores the tests' own processes use, and torch's threads then wait on each other."""

    def __init__(self, tool: str, command: list | None = None):
        """`tool`: a file in tools/ (run with this Python), or the name of `command` where one is given."""
        self.tool = tool
        self.command = command or [sys.executable, str(REPO / "tools" / tool)]
        self.proc: subprocess.Popen | None = None
        self.work: Path | None = None

    def start(self, work: Path, argv: list, env: dict | None = None):
        self.work = work
        env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
        with open(work / "stdout.txt", "w") as out, open(work / "stderr.txt", "w") as err:
            self.proc = subprocess.Popen([*self.command, *map(str, argv)], stdout=out, stderr=err,
                                         start_new_session=True, env=env, preexec_fn=_lowest_priority)

    def _priority(self, nice: int):
        """Its autogroup's and its processes' nice value; back to 0 only where this process may (as root; otherwise
        the suite waiting on it leaves it the machine anyway)."""
        if self.proc.poll() is None:
            _set_autogroup_nice(self.proc.pid, nice)
            try:
                os.setpriority(os.PRIO_PGRP, self.proc.pid, nice)  # it and the children it forked
            except OSError:
                pass

    def _failed(self, what: str):
        _kill_group(self.proc)
        stderr = (self.work / "stderr.txt").read_text()
        raise AssertionError(f"{self.tool} {what}; its stderr ends:\n{stderr[-4000:]}")

    def ended(self, timeout: float = 1800) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once it ends: waited on at normal priority, with a limit generous for a
        machine that other work keeps busy."""
        assert self.proc is not None, f"{self.tool} was not started at collection"
        self._priority(0)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._failed(f"ended not within {timeout:.0f} s of being waited on")
        return (self.proc.returncode, (self.work / "stdout.txt").read_text(),
                (self.work / "stderr.txt").read_text())

    def output(self, timeout: float = 1800) -> str:
        """What it printed, once it ends (it failing fails the test)."""
        status, stdout, _ = self.ended(timeout)
        if status != 0:
            self._failed(f"failed (exit status {status})")
        return stdout

    def wait_for(self, names: list[str], timeout: float = 900) -> list[Path]:
        """Its files `names` (in its work folder), once it has written them all (each by an atomic rename), at
        normal priority while waited on and back at the lowest after, if it goes on to write more."""
        import time
        assert self.proc is not None, f"{self.tool} was not started at collection"
        paths = [self.work / name for name in names]
        deadline = time.monotonic() + timeout
        self._priority(0)
        while not all(path.exists() for path in paths):
            if self.proc.poll() is not None:
                missing = [path.name for path in paths if not path.exists()]
                if not missing:  # written just before it ended
                    break
                self._failed(f"ended (exit status {self.proc.returncode}) without writing {missing}")
            if time.monotonic() > deadline:
                self._failed(f"wrote not all of {names} within {timeout:.0f} s of being waited on")
            time.sleep(0.2)
        self._priority(19)
        return paths

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc)


DISTILL_QUALITY = BackgroundRun("distill_quality.py")  # ~3.5 minutes of one core
PYPI_INDEX = "https://pypi.org/simple"
PIP_COMMAND = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--isolated",
               "--disable-pip-version-check", "--index-url", PYPI_INDEX, "--quiet"]
PIP_ENV = {"PATH": "/usr/bin:/bin"}  # PyPI only: the machine's pip configuration and this venv's variables left out
# pip's whole resolution of the README's install (~40 s, mostly pip's own CPU time): from the session's start
PLAIN_INSTALL = BackgroundRun("pip's dry run of a plain install", PIP_COMMAND)
TINY_MODEL_BUILD = BackgroundRun("tiny_models.py")  # the tiny models the selected tests put into the server
TINY_VAE_FLAGS = {"vae16": "--vae16", "vae4": "--vae4", "wan_vae": "--wan-vae"}  # tiny_models' VAEs: the tool's flags
_TINY_MODELS_PREBUILT: dict = {"families": {}}  # what TINY_MODEL_BUILD makes: tiny_models' keyword arguments


def _tiny_models_wanted(items) -> dict:
    """The tiny models and VAEs the selected tests' `tiny_models` markers name (tiny_models' keyword arguments),
    merged; two tests wanting a family in two dtypes, or two files for one VAE, is an error of the tests, named."""
    wanted: dict = {"families": {}}
    for item in items:
        for marker in item.iter_markers("tiny_models"):
            if marker.args or not set(marker.kwargs) <= {"families", *TINY_VAE_FLAGS}:
                raise pytest.UsageError(f"{item.nodeid}: the tiny_models marker takes tiny_models' keyword "
                                        f"arguments (families, {', '.join(TINY_VAE_FLAGS)}), not {marker}")
            merges = [(wanted["families"], family, dtype)
                      for family, dtype in marker.kwargs.get("families", {}).items()]
            merges += [(wanted, key, name) for key, name in marker.kwargs.items() if key != "families"]
            for held, key, value in merges:
                if held.setdefault(key, value) != value:
                    raise pytest.UsageError(f"{item.nodeid} wants {key} as {value!r}, another selected test as "
                                            f"{held[key]!r} (tiny_models markers)")
    return wanted


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    temp = session.config._tmp_path_factory
    if any(map(_needs_plain_install, session.items)):
        work = temp.mktemp("plain_install")
        PLAIN_INSTALL.start(work, ["--report", work / "report.json", "-r", REPO / readme_requirement_files()[0]],
                            env=PIP_ENV)
    if not comfyui_available():
        return
    if any(map(_needs_distill_quality, session.items)) and not SKIP_DISTILL_QUALITY:
        work = temp.mktemp("distill_quality")
        DISTILL_QUALITY.start(work, ["--work", work / "check"])
    wanted = _tiny_models_wanted(session.items)
    if wanted["families"] or len(wanted) > 1:
        out = temp.mktemp("tiny_models")
        argv = ["--out-dir", out, "--families", *(f"{f}:{d}" for f, d in wanted["families"].items())]
        for key, flag in TINY_VAE_FLAGS.items():
            if key in wanted:
                argv += [flag, out / wanted[key]]
        TINY_MODEL_BUILD.start(out, argv)
        _TINY_MODELS_PREBUILT.update(wanted)


def readme_requirement_files() -> list[str]:
    """The requirement files the README's install commands hand pip (`-r <folder>/<file>`), as files of the pack."""
    install = (REPO / "README.md").read_text(encoding="utf-8").split("## Install", 1)[1].split("\n## ", 1)[0]
    return [re.split(r"[/\\]", path)[-1] for path in re.findall(r"pip install -r ([^\s`]+)", install)]


@pytest.fixture(scope="session")
def distill_quality_figures():
    """The distillation quality check's figures, from the run started at collection."""
    result = json.loads(DISTILL_QUALITY.output().strip().splitlines()[-1])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "distill_quality.json").write_text(json.dumps(result, indent=1))
    return result


def pytest_terminal_summary(terminalreporter):
    if not comfyui_available():
        terminalreporter.write_line(COMFYUI_MISSING, yellow=True, bold=True)


@pytest.fixture(scope="session")
def assets(tmp_path_factory, tools):
    """The embedded default: tiny SD1.5 checkpoint and 8 captioned 64x64 images (tools/embedded_default.py, run in
    the tool worker: its ComfyUI import is the worker's)."""
    if not comfyui_available():
        pytest.skip(COMFYUI_MISSING)
    root = tmp_path_factory.mktemp("assets")
    ckpt, images = root / CHECKPOINT_NAME, root / "images"
    tools("embedded_default", ["--checkpoint", ckpt, "--images", images])
    return {"checkpoint": ckpt, "images": images}


_TINY_MODELS_BUILT: dict[Path, str] = {}  # file → the dtype it was written in, this session


def tiny_models(tools, server, families: dict[str, str] = (), vae16: str | None = None, vae4: str | None = None,
                wan_vae: str | None = None) -> None:
    """Puts the tiny models (`families`: family → dtype, as models/diffusion_models/tiny_<family>.safetensors) and
    VAEs (tiny 16- and 4-channel TAESD, the Wan VAE: the file names given, in models/vae) into the session's
    server, each once a session, whichever module needs it first; the same seeds every time, so a file is what any
    module would build. What a selected test's `tiny_models` marker names (the same keyword arguments) is built in
    the background from the session's start (TINY_MODEL_BUILD) and linked from there once written; anything else
    is built here, in the tool worker (tools/tiny_models.py)."""
    unets, vaes = server.dir("models", "diffusion_models"), server.dir("models", "vae")
    prebuilt, argv, links = _TINY_MODELS_PREBUILT, [], []
    for family, dtype in dict(families).items():
        out = unets / f"tiny_{family}.safetensors"
        if out.exists():
            assert _TINY_MODELS_BUILT.get(out, dtype) == dtype, \
                f"{out.name} was built in {_TINY_MODELS_BUILT[out]} this session, not {dtype}"
            continue
        _TINY_MODELS_BUILT[out] = dtype
        if prebuilt["families"].get(family) == dtype:
            links.append(out)
        else:
            argv.append(f"{family}:{dtype}")
    argv = ["--out-dir", unets, "--families", *argv] if argv else []
    for key, name in (("vae16", vae16), ("vae4", vae4), ("wan_vae", wan_vae)):
        if name and not (vaes / name).exists():
            if prebuilt.get(key) == name:
                links.append(vaes / name)
            else:
                argv += [TINY_VAE_FLAGS[key], vaes / name]
    if links:
        for link, built in zip(links, TINY_MODEL_BUILD.wait_for([link.name for link in links])):
            link.symlink_to(built)
    if argv:
        tools("tiny_models", argv, timeout=900)


@pytest.fixture(scope="module")
def tiny_unet(assets, tmp_path_factory):
    """The embedded default checkpoint's diffusion model as a bf16 file of its own (what UNETLoader lists), in a
    folder of each test module's own."""
    import torch
    from safetensors.torch import load_file, save_file
    prefix = "model.diffusion_model."
    out = tmp_path_factory.mktemp("fp8_unet") / "tiny_unet.safetensors"
    save_file({k[len(prefix):]: v.to(torch.bfloat16) if v.is_floating_point() else v
               for k, v in load_file(assets["checkpoint"]).items() if k.startswith(prefix)}, out)
    return out


@pytest.fixture(scope="session")
def comfy(tmp_path_factory, assets):
    """One real ComfyUI server, headless, with the pack installed under a non-identifier folder name."""
    base = tmp_path_factory.mktemp("comfy")
    server = ComfyServer(base, pack_name="InGraph-Trainer-test.v1", extra_env={"INGRAPH_TEST_CANARY": ENV_CANARY})
    # test-only nodes (synthetic text encoders for families whose real ones are too large to build)
    server.dir("custom_nodes")
    (base / "custom_nodes" / "ingraph_test_nodes").symlink_to(REPO / "tests" / "comfy_nodes" / "ingraph_test_nodes",
                                                             target_is_directory=True)
    (server.dir("models", "checkpoints") / CHECKPOINT_NAME).symlink_to(assets["checkpoint"])
    images = server.dir("input", IMAGE_FOLDER)
    for f in assets["images"].iterdir():
        (images / f.name).write_bytes(f.read_bytes())
    one = server.dir("input", ONE_IMAGE_FOLDER)
    for f in sorted(assets["images"].iterdir())[:2]:  # item_000.png, item_000.txt
        (one / f.name).write_bytes(f.read_bytes())
    server.start().wait_ready(180)
    yield server
    server.stop()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "comfyui-server.log").write_text(server.log_text())


@pytest.fixture
def client(comfy):
    from client.api import ComfyClient
    c = ComfyClient(comfy.address)
    yield c
    try:  # a test that failed half-way leaves no queued or running prompt to the tests after it on this server
        c.post("/queue", {"clear": True})
        c.post("/interrupt")
    finally:
        c.close()


def load_workflow(name: str = "train_lora_api.json") -> dict:
    return json.loads((REPO / "workflows" / "api" / name).read_text())


def evaluate_on_one_image(wf: dict, train: str = "6", dataset: str = "2", folder: str = ONE_IMAGE_FOLDER,
                          quantiles: str = SUITE_EVAL_QUANTILES) -> list:
    """The Train node's evaluations (after the last step, and before the first with eval_before) on one image, not the 8 it trains
    on, at `quantiles` (its eval_quantiles), for tests whose point is not the evaluation: a copy of the dataset
    chain from node `dataset` (Load Training Images → Cache Latents → Cache Text Embeddings) on `folder` (an image
    and its caption) as its eval_dataset. Returns that cached dataset's link (for an Evaluate node that must
    measure the same)."""
    import copy
    chain = [dataset]
    while len(chain) < 3:
        chain.append(next(k for k, v in wf.items() if v["inputs"].get("dataset") == [chain[-1], 0]))
    for node in chain:
        clone = copy.deepcopy(wf[node])
        if node == dataset:
            clone["inputs"]["folder"] = folder
        else:
            clone["inputs"]["dataset"][0] = "eval_" + clone["inputs"]["dataset"][0]
        wf["eval_" + node] = clone
    wf[train]["inputs"]["eval_dataset"] = ["eval_" + chain[-1], 0]
    wf[train]["inputs"]["eval_quantiles"] = quantiles
    return ["eval_" + chain[-1], 0]


@pytest.fixture(scope="session")
def tools(tmp_path_factory):
    """`tools(name, argv)` runs tools/<name>.py's main (prepare_run, cache_dataset) in one worker process kept for
    the session (tests/helpers/tool_worker.py), so ComfyUI is imported once, not once per run; returns what it printed."""
    import select
    log = tmp_path_factory.mktemp("tool_worker") / "tool_worker.log"
    workers: list[subprocess.Popen] = []

    def worker() -> subprocess.Popen:
        if not workers or workers[0].poll() is not None:
            with open(log, "a") as log_file:
                workers[:] = [subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / "tool_worker.py")],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                               text=True, cwd=log.parent, start_new_session=True)]
        return workers[0]

    def run_tool(name: str, argv: list[str], timeout: float = 300, copies: int | None = None) -> str | list[str]:
        """`copies`: that many children run the tool at once (separate processes); the list of what each printed."""
        request = {"tool": name, "argv": [str(a) for a in argv], **({"copies": copies} if copies else {})}
        worker().stdin.write(json.dumps(request) + "\n")
        workers[0].stdin.flush()
        ready, _, _ = select.select([workers[0].stdout], [], [], timeout)
        line = workers[0].stdout.readline() if ready else ""
        if not line:  # its late answer would be read as the next request's: the next request starts a new worker
            _kill_group(workers[0])
            raise AssertionError(f"the tool worker gave no answer for {name} {argv}; its log ends:\n"
                                 + log.read_text()[-4000:])
        answers = json.loads(line) if copies else [json.loads(line)]
        for answer in answers:
            assert answer["ok"], f"tools/{name}.py {argv} failed:\n{answer['error']}\n{log.read_text()[-3000:]}"
        return [answer["stdout"] for answer in answers] if copies else answers[0]["stdout"]
    yield run_tool
    if workers and workers[0].poll() is None:
        workers[0].stdin.close()
        try:
            workers[0].wait(30)
        except subprocess.TimeoutExpired:
            _kill_group(workers[0])


def _kill_group(proc: subprocess.Popen):
    """A worker started in its own session, and the children it forked."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, assets, tools):
    """A cache and materialised model shared by trainer-tier tests; `make_run(*flags, **overrides)` writes a spec
    with tools/prepare_run.py (flags: its own, such as --prior-images DIR)."""
    work = tmp_path_factory.mktemp("trainer")
    counter = {"n": 0}

    def make_run(*flags, **overrides) -> Path:
        counter["n"] += 1
        run_dir = work / f"run{counter['n']}"
        args = ["--checkpoint", str(assets["checkpoint"]), "--images", str(assets["images"]),
                "--run-dir", str(run_dir), *flags]
        for key, value in overrides.items():
            args += ["--set", f"{key.replace('__', '.')}={json.dumps(value)}"]
        return Path(tools("prepare_run", args).strip().splitlines()[-1])
    return make_run


# a 3-step LoRA whose file format is the point (tests/trainer/test_export_formats.py reads each back with diffusers,
# tests/trainer/test_trainer_program.py starts a run from the kohya one)
FORMAT_RUN = dict(train__steps=3, train__learning_rate=1e-2, train__precision="fp32", adapter__rank=4,
                  adapter__alpha=8.0, adapter__targets="attention_ff", train__eval_quantiles=[0.5],
                  train__eval_before=True)


@pytest.fixture(scope="session")
def trained_in_format(prepared):
    """`trained_in_format(file_format)`: the spec path of a finished FORMAT_RUN writing that format; trained once
    per format per session, however many tests read it."""
    runs: dict[str, Path] = {}

    def get(file_format: str) -> Path:
        if file_format not in runs:
            spec = prepared(**FORMAT_RUN, output__format=file_format)
            proc = run_trainer(spec)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[file_format] = spec
        return runs[file_format]
    return get


class _TrainerWorker:
    """tests/helpers/train_forked.py --serve, started on first use and kept for the session: the trainer program's main in a
    child forked after a standby trainer's imports (ComfyUI's included), for each run (~12 s of imports saved a run
    on 2 cores)."""
    proc: subprocess.Popen | None = None
    log: Path | None = None

    @classmethod
    def run(cls, argv: list[str], cwd: Path, timeout: float, processes: int = 1, env: dict | None = None,
            patch: str | None = None, program: str | None = None,
            kill_on: str | None = None) -> subprocess.CompletedProcess:
        import select
        import tempfile
        if cls.proc is None or cls.proc.poll() is not None:
            cls.log = Path(tempfile.mkstemp(prefix="ingraph-trainer-worker-", suffix=".log")[1])
            with open(cls.log, "w") as log_file:
                cls.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / "train_forked.py"), "--serve"],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                            start_new_session=True)
        cls.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "timeout": timeout, "processes": processes,
                                         "env": env or {}, "patch": patch, "program": program,
                                         "kill_on": kill_on}) + "\n")
        cls.proc.stdin.flush()
        ready, _, _ = select.select([cls.proc.stdout], [], [], timeout + 120)  # + the worker's own imports
        line = cls.proc.stdout.readline() if ready else ""
        if not line:  # its late answer would be read as the next run's: the next run starts a new worker
            _kill_group(cls.proc)
            cls.proc = None
            raise AssertionError(f"the trainer worker gave no answer for {argv}; its log ends:\n"
                                 + cls.log.read_text()[-4000:])
        answer = json.loads(line)
        return subprocess.CompletedProcess(["trainer", *argv], answer["returncode"], answer["stdout"], answer["stderr"])

    @classmethod
    def stop(cls):
        if cls.proc is not None:
            cls.proc.stdin.close()
            try:
                cls.proc.wait(30)
            except subprocess.TimeoutExpired:
                _kill_group(cls.proc)
            cls.proc = None
        if cls.log is not None:  # read only into a failing test's message, while the session runs
            cls.log.unlink(missing_ok=True)
            cls.log = None


def pytest_sessionfinish(session, exitstatus):
    _TrainerWorker.stop()
    DISTILL_QUALITY.stop()
    PLAIN_INSTALL.stop()
    TINY_MODEL_BUILD.stop()


def run_trainer(spec_path: Path, *extra, timeout: float = 300, processes: int = 1, env: dict | None = None,
                patch: str | None = None, kill_on: str | None = None) -> subprocess.CompletedProcess:
    """The trainer program's main on `--config spec_path *extra`, started in the spec's folder, in a child forked
    from the session's trainer worker (the imports paid once; `processes` > 1: that many ranks, given what the
    DeepSpeed launcher gives its ranks; `env`: variables the run gets; `patch`: tests/<patch>.py's install() runs
    before the program's main, as tests/helpers/inject_nan.py has it; `kill_on`: an event type, the run SIGKILLed once its
    events hold one); stdout, stderr and exit status are the run's own.
    run_trainer_program starts the program itself, where its start is the point."""
    return _TrainerWorker.run(["--config", str(spec_path), *map(str, extra)], spec_path.parent, timeout, processes,
                              env, patch, kill_on=kill_on)


def run_forked_program(name: str, argv: list, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """tests/helpers/<name>.py's main(argv) in a child forked from the session's trainer worker (tests/helpers/optimizer_runs.py:
    the trainer's own Trainer in-process, its imports paid once)."""
    return _TrainerWorker.run([str(a) for a in argv], cwd, timeout, program=name)


def run_trainer_program(spec_path: Path, *extra, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "trainer"), "--config", str(spec_path), *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=spec_path.parent)


def run_trainers_forked(*spec_paths: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The trainer program on each spec in turn (run_trainer: each run its own process, the imports shared), for
    tests comparing runs of the same program. `.statuses`: {spec path: exit status}; stdout and stderr joined."""
    budget = timeout * len(spec_paths)  # as one program running them all had: each run may take the whole budget
    runs = {Path(spec): run_trainer(Path(spec), timeout=budget) for spec in spec_paths}
    proc = subprocess.CompletedProcess([str(s) for s in spec_paths], 0 if all(r.returncode == 0 for r in runs.values())
                                       else 1, "".join(r.stdout for r in runs.values()),
                                       "".join(r.stderr for r in runs.values()))
    proc.statuses = {spec: run.returncode for spec, run in runs.items()}
    return proc


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_first_step(client, prompt_id: str, timeout: float = 240, at_least: int = 0) -> dict:
    """Follows websocket messages until the prompt's first training step (or its first step numbered
    `at_least` or more); returns that ingraph.event's data."""
    return client.wait_for_step(prompt_id, at_least, timeout)[0]


@pytest.fixture(autouse=True)
def _comfyui_not_training_after_the_test():
    """A test that prepares a model for training in this process sets ComfyUI 0.33's process-wide training switch
    (comfy_compat.enter_training); the next test compares against ComfyUI as users run it, with it off."""
    yield
    management = sys.modules.get("comfy.model_management")
    if management is not None and hasattr(management, "in_training"):
        management.in_training = False


def small_server(assets, base_dir, **server_args) -> ComfyServer:
    """A ComfyUI server of a test's own (not the session's), started and ready, holding the tiny checkpoint, the
    example images and the one-image folder: for tests that kill, fake or otherwise spoil their server."""
    server = ComfyServer(base_dir, **server_args)
    (server.dir("models", "checkpoints") / CHECKPOINT_NAME).symlink_to(assets["checkpoint"])
    images, one = server.dir("input", IMAGE_FOLDER), server.dir("input", ONE_IMAGE_FOLDER)
    for f in assets["images"].iterdir():
        (images / f.name).write_bytes(f.read_bytes())
    for f in sorted(assets["images"].iterdir())[:2]:
        (one / f.name).write_bytes(f.read_bytes())
    return server.start().wait_ready(180)


def write_upstream_lora(checkpoint: Path, path: Path, rank: int = 2):
    """A small LoRA on every to_q of the checkpoint's UNet, in ComfyUI's key layout."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    tensors, g = {}, torch.Generator().manual_seed(3)
    with safe_open(str(checkpoint), "pt") as f:
        for key in f.keys():
            if re.search(r"^model\.diffusion_model\..*\.attn[12]\.to_q\.weight$", key):
                out_f, in_f = f.get_slice(key).get_shape()
                module = key[len("model."):-len(".weight")]
                tensors[f"{module}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * 0.1
                tensors[f"{module}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * 0.1
                tensors[f"{module}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path))


def model_overrides(path, weight_dtype: str) -> dict:
    return dict(model__path=str(path), model__format="diffusion_model", model__weight_dtype=weight_dtype,
                model__lora_paths=[], model__lora_strengths=[], model__stamps=[])


def training_only(name: str, steps: int, **train_inputs) -> dict:
    wf = {k: v for k, v in load_workflow().items() if k in {"1", "2", "3", "4", "5", "6", "7"}}
    # fp32: bf16 convolutions on a CPU are several times slower (each test's time is mostly evaluation)
    wf["6"]["inputs"].update(steps=steps, output_name=name, **{"precision": "fp32", **train_inputs})
    evaluate_on_one_image(wf)  # evaluation is not these tests' point
    return wf
