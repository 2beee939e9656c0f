"""Test tiers: unit (always), trainer program and ComfyUI server (need COMFYUI_PATH).

Where ComfyUI is absent, every test that needs it is skipped and one line says so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.comfy_server import ComfyServer, comfyui_available, comfyui_path  # noqa: E402

if "ingraph_trainer" not in sys.modules:  # the pack as a package, as ComfyUI and the trainer see it
    import types
    _pkg = types.ModuleType("ingraph_trainer")
    _pkg.__path__ = [str(REPO)]
    sys.modules["ingraph_trainer"] = _pkg

COMFYUI_MISSING = f"skipped: ComfyUI not found at {comfyui_path()} (set COMFYUI_PATH)"
ARTIFACTS = Path(os.environ.get("INGRAPH_TEST_ARTIFACTS", REPO / "test-artifacts"))
CHECKPOINT_NAME = "ingraph_tiny_sd15.safetensors"
# in the test server's environment: nothing a client can read may ever carry it (tests/test_run_control.py)
ENV_CANARY = "ingraph-canary-" + os.urandom(8).hex()
IMAGE_FOLDER = "ingraph_example"


def pytest_report_header(config):
    return f"ComfyUI: {comfyui_path()}" if comfyui_available() else COMFYUI_MISSING


def pytest_collection_modifyitems(config, items):
    if comfyui_available():
        return
    skip = pytest.mark.skip(reason=COMFYUI_MISSING)
    for item in items:
        if "comfyui" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if not comfyui_available():
        terminalreporter.write_line(COMFYUI_MISSING, yellow=True, bold=True)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The embedded default: tiny SD1.5 checkpoint and 8 captioned 64x64 images."""
    if not comfyui_available():
        pytest.skip(COMFYUI_MISSING)
    root = tmp_path_factory.mktemp("assets")
    ckpt, images = root / CHECKPOINT_NAME, root / "images"
    subprocess.run([sys.executable, str(REPO / "tools" / "embedded_default.py"), "--checkpoint", str(ckpt),
                    "--images", str(images)], check=True, capture_output=True, timeout=300)
    return {"checkpoint": ckpt, "images": images}


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
    return json.loads((REPO / "workflows" / name).read_text())


@pytest.fixture(scope="session")
def tools(tmp_path_factory):
    """`tools(name, argv)` runs tools/<name>.py's main (prepare_run, cache_dataset) in one worker process kept for
    the session (tests/tool_worker.py), so ComfyUI is imported once, not once per run; returns what it printed."""
    import select
    log = tmp_path_factory.mktemp("tool_worker") / "tool_worker.log"
    with open(log, "w") as log_file:
        worker = subprocess.Popen([sys.executable, str(REPO / "tests" / "tool_worker.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=log.parent)

    def run_tool(name: str, argv: list[str], timeout: float = 300) -> str:
        worker.stdin.write(json.dumps({"tool": name, "argv": [str(a) for a in argv]}) + "\n")
        worker.stdin.flush()
        ready, _, _ = select.select([worker.stdout], [], [], timeout)
        line = worker.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"the tool worker gave no answer for {name} {argv}; its log ends:\n"
                                 + log.read_text()[-4000:])
        answer = json.loads(line)
        assert answer["ok"], f"tools/{name}.py {argv} failed:\n{answer['error']}\n{log.read_text()[-3000:]}"
        return answer["stdout"]
    yield run_tool
    worker.stdin.close()
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


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


# a 3-step LoRA whose file format is the point (tests/test_export_formats.py reads each back with diffusers,
# tests/test_trainer_program.py starts a run from the kohya one)
FORMAT_RUN = dict(train__steps=3, train__learning_rate=1e-2, train__precision="fp32", adapter__rank=4,
                  adapter__alpha=8.0, adapter__targets="attention_ff", train__eval_quantiles=[0.5])


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


def run_trainer(spec_path: Path, *extra, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "trainer"), "--config", str(spec_path), *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=spec_path.parent)


def run_trainers_forked(*spec_paths: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The trainer program on each spec in turn, each run in a child forked after one shared import
    (tests/train_forked.py): for tests comparing runs of the same program, one import instead of one per run.
    `.statuses`: {spec path: exit status}."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "train_forked.py"), *map(str, spec_paths)],
                          capture_output=True, text=True, timeout=timeout * len(spec_paths))
    try:
        proc.statuses = {Path(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    except (IndexError, ValueError):
        proc.statuses = {}
    return proc


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_first_step(client, prompt_id: str, timeout: float = 240, at_least: int = 0) -> dict:
    """Follows websocket messages until the prompt's first training step (or its first step numbered
    `at_least` or more); returns that ingraph.event's data."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client._ws.settimeout(5)
        try:
            raw = client._ws.recv()
        except Exception:
            continue
        if isinstance(raw, bytes):
            continue
        m = json.loads(raw)
        data = m.get("data") or {}
        if data.get("prompt_id") not in (None, prompt_id):
            continue
        if m.get("type") == "ingraph.event" and data["event"]["type"] == "step" and data["event"]["step"] >= at_least:
            return data
        if m.get("type") in ("execution_error", "execution_success", "execution_interrupted"):
            raise AssertionError(f"prompt ended before training: {m}")
    raise AssertionError("no step event")
