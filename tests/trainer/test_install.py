"""Installability where users are: every runtime requirement has a wheel for Windows (Python 3.12 and 3.13, ComfyUI
portable's) and for Linux x86_64 and aarch64, so `pip install -r requirements.txt` never needs a compiler; and
DeepSpeed is only in the multi-GPU extra. Asked of PyPI with pip's resolver (metadata only, nothing installed);
skipped with one line where no package index answers."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import PIP_COMMAND, PIP_ENV, PLAIN_INSTALL, PYPI_INDEX, REPO, readme_requirement_files

MANYLINUX = ["manylinux_2_28_{arch}", "manylinux_2_27_{arch}", "manylinux_2_24_{arch}", "manylinux_2_17_{arch}",
             "manylinux2014_{arch}"]
TARGETS = {
    "windows-py3.12": (["win_amd64"], "3.12"),
    "windows-py3.13": (["win_amd64"], "3.13"),
    "linux-x86_64-py3.12": ([t.format(arch="x86_64") for t in MANYLINUX], "3.12"),
    "linux-aarch64-py3.12": ([t.format(arch="aarch64") for t in MANYLINUX], "3.12"),
}
UNREACHABLE = ("Could not fetch URL", "Failed to establish a new connection", "Temporary failure in name resolution",
               "No route to host", "Network is unreachable", "ProxyError", "ConnectTimeout")


def requirements(name: str) -> list[str]:
    lines = (REPO / name).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def report_of(status: int, stderr: str, report: Path) -> dict:
    if status != 0 and any(marker in stderr for marker in UNREACHABLE):
        pytest.skip(f"skipped: no package index reachable at {PYPI_INDEX}")
    assert status == 0, stderr[-3000:]
    return json.loads(report.read_text())


def resolve(tmp_path, args: list[str]) -> dict:
    """pip's dry-run report for `args` (PyPI only, the machine's pip configuration left out)."""
    report = tmp_path / "report.json"
    proc = subprocess.run([*PIP_COMMAND, "--report", str(report), *args], capture_output=True, text=True,
                          timeout=600, env=PIP_ENV)
    return report_of(proc.returncode, proc.stderr, report)


@pytest.fixture
def plain_install_report() -> dict:
    """pip's whole resolution of the README's install command (requirements.txt, dependencies included), for this
    machine (Linux): started with the session (conftest.PLAIN_INSTALL), since it takes ~40 s."""
    status, _, stderr = PLAIN_INSTALL.ended(timeout=600)
    return report_of(status, stderr, PLAIN_INSTALL.work / "report.json")


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_runtime_requirement_has_a_wheel(tmp_path, target):
    platforms, python = TARGETS[target]
    wanted = requirements("requirements.txt")
    report = resolve(tmp_path, ["--no-deps", "--only-binary=:all:", "--target", str(tmp_path / "t"),
                                "--python-version", python, *[a for p in platforms for a in ("--platform", p)],
                                *wanted])
    found = {item["metadata"]["name"].lower().replace("_", "-"): item["download_info"]["url"]
             for item in report["install"]}
    assert len(found) == len(wanted), (sorted(found), wanted)
    assert all(url.endswith(".whl") for url in found.values()), found


def test_deepspeed_is_only_in_the_multi_gpu_extra():
    runtime = requirements("requirements.txt")
    extra = requirements("requirements-multi-gpu.txt")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [r for r in runtime + project["dependencies"] if r.lower().startswith("deepspeed")]
    assert extra == project["optional-dependencies"]["multi-gpu"] == ["deepspeed>=0.16"]
    assert sorted(runtime) == sorted(project["dependencies"])  # the two lists of runtime requirements agree


def test_the_readmes_install_commands_name_the_packs_requirement_files():
    named = readme_requirement_files()
    assert named[:3] == ["requirements.txt"] * 3  # a venv, a manual install, Windows portable
    assert "requirements-multi-gpu.txt" in named
    assert all((REPO / name).is_file() for name in named), named


def test_a_plain_install_pulls_in_no_deepspeed(plain_install_report):
    """The whole resolution, dependencies included, for this machine (Linux), of the file the README's install
    command names: DeepSpeed is not among them."""
    report = plain_install_report
    names = {item["metadata"]["name"].lower() for item in report["install"]}
    assert "diffusers" in names and "peft" in names
    assert "deepspeed" not in names


def setup_torch_plan(tmp_path, path: str, cpu_index: str) -> str:
    """What scripts/setup.sh says it will install for torch (INGRAPH_SETUP_PLAN=1: it decides, prints, stops)."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60,
                          env={"PATH": path, "PYTHON": sys.executable, "INGRAPH_SETUP_PLAN": "1",
                               "INGRAPH_CPU_TORCH_INDEX": cpu_index, "INGRAPH_VENV": str(tmp_path / "venv"),
                               "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "venv").exists()  # the plan installs nothing
    return proc.stderr


def test_setup_takes_the_cpu_build_of_torch_where_there_is_no_gpu_and_the_cpu_index_answers(tmp_path):
    """Issue 32: no NVIDIA GPU and PyTorch's CPU index answering: the CPU build, said with its size before anything
    downloads; a GPU, or no answer: the default index's CUDA build, said with its size and why."""
    import http.server
    import shutil
    import threading
    if shutil.which("nvidia-smi", path="/usr/bin:/bin") or Path("/proc/driver/nvidia/version").exists():
        pytest.skip("skipped: this machine has an NVIDIA GPU, so the no-GPU choice cannot be shown")
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<html></html>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "index"))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answering = f"http://127.0.0.1:{server.server_port}"
        said = setup_torch_plan(tmp_path, "/usr/bin:/bin", answering)
        assert f"the CPU build from {answering}" in said and "no nvidia-* packages" in said, said
        fake_gpu = tmp_path / "gpu-bin"
        fake_gpu.mkdir()
        (fake_gpu / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (fake_gpu / "nvidia-smi").chmod(0o755)
        said = setup_torch_plan(tmp_path, f"{fake_gpu}:/usr/bin:/bin", answering)
        assert "the CUDA build" in said and "an NVIDIA GPU found" in said, said
    finally:
        server.shutdown()
        server.server_close()
    said = setup_torch_plan(tmp_path, "/usr/bin:/bin", answering)  # the server is gone: refused at once
    assert "the CUDA build" in said and f"{answering} does not answer" in said, said


def test_an_extra_cpu_index_makes_pip_choose_the_cpu_build_of_the_same_pin(tmp_path):
    """What setup relies on: with the CPU index beside the default one, pip takes `torch==X` as the CPU build
    (`X+cpu` is the newer version of the same pin). A stand-in CPU index holds a metadata-only torch wheel."""
    import base64
    import hashlib
    import zipfile
    pin = next(p for p in (REPO / "scripts" / "setup.sh").read_text().split('TORCH_PINS="${INGRAPH_TORCH_PINS:-', 1)[1]
               .split("}", 1)[0].split() if p.startswith("torch=="))
    version = pin.split("==")[1] + "+cpu"
    wheel = tmp_path / "index" / "torch" / f"torch-{version}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    files = {f"torch-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"torch-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
                     f"{len(text)}\n" for name, text in files.items())
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr(f"torch-{version}.dist-info/RECORD", record + f"torch-{version}.dist-info/RECORD,,\n")
    (wheel.parent / "index.html").write_text(f'<html><body><a href="{wheel.name}">{wheel.name}</a></body></html>')
    alone = resolve(tmp_path, ["--no-deps", pin])  # the precondition: the default index has the pin's own build
    assert [item["metadata"]["version"] for item in alone["install"]] == [pin.split("==")[1]]
    report = resolve(tmp_path, ["--no-deps", "--extra-index-url", (tmp_path / "index").as_uri(), pin])
    assert [item["metadata"]["version"] for item in report["install"]] == [version]
