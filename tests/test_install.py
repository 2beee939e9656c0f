"""Installability where users are: every runtime requirement has a wheel for Windows (Python 3.12 and 3.13, ComfyUI
portable's) and for Linux x86_64 and aarch64, so `pip install -r requirements.txt` never needs a compiler; and
DeepSpeed is only in the multi-GPU extra. Asked of PyPI with pip's resolver (metadata only, nothing installed);
skipped with one line where no package index answers."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO

INDEX = "https://pypi.org/simple"
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


def resolve(tmp_path, args: list[str]) -> dict:
    """pip's dry-run report for `args` (PyPI only, the machine's pip configuration left out)."""
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--isolated",
                           "--disable-pip-version-check", "--index-url", INDEX, "--quiet", "--report", str(report),
                           *args], capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin"})
    if proc.returncode != 0 and any(marker in proc.stderr for marker in UNREACHABLE):
        pytest.skip(f"skipped: no package index reachable at {INDEX}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(report.read_text())


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


def readme_requirement_files() -> list[str]:
    """The requirement files the README's install commands hand pip (`-r <folder>/<file>`), as files of the pack."""
    import re
    install = (REPO / "README.md").read_text(encoding="utf-8").split("## Install", 1)[1].split("\n## ", 1)[0]
    return [re.split(r"[/\\]", path)[-1] for path in re.findall(r"pip install -r ([^\s`]+)", install)]


def test_the_readmes_install_commands_name_the_packs_requirement_files():
    named = readme_requirement_files()
    assert named[:2] == ["requirements.txt", "requirements.txt"]  # Linux/macOS and Windows portable
    assert "requirements-multi-gpu.txt" in named
    assert all((REPO / name).is_file() for name in named), named


def test_a_plain_install_pulls_in_no_deepspeed(tmp_path):
    """The whole resolution, dependencies included, for this machine (Linux), of the file the README's install
    command names: DeepSpeed is not among them."""
    report = resolve(tmp_path, ["-r", str(REPO / readme_requirement_files()[0])])
    names = {item["metadata"]["name"].lower() for item in report["install"]}
    assert "diffusers" in names and "peft" in names
    assert "deepspeed" not in names
