"""DeepSpeed hostfiles (`hostname slots=N` per line), parsed and checked here before DeepSpeed sees them.

The hostfile is a path a client types into a node, so its errors give line numbers only: a path
such as /proc/self/environ must never have its contents echoed into an error that a client can read.
Standard library only: the spec validation in the ComfyUI process uses it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

MAX_BYTES = 64 * 1024  # a hostfile for thousands of machines fits; anything bigger is not a hostfile
HOST_LINE = re.compile(r"^([A-Za-z0-9](?:[A-Za-z0-9._-]{0,252}[A-Za-z0-9])?)[ \t]+slots=([0-9]{1,6})$")


ALLOWED_HOSTS_ENV = "INGRAPH_ALLOWED_HOSTS"  # the machines a hostfile may name, set by the server's operator
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def allowed_hosts() -> set[str]:
    """This machine, and what the operator lists in INGRAPH_ALLOWED_HOSTS (commas or spaces between): any client can
    give a hostfile, and DeepSpeed's launcher reaches every host in it over ssh with the server's keys."""
    import socket
    listed = os.environ.get(ALLOWED_HOSTS_ENV, "").replace(",", " ").split()
    return {*listed, *LOCAL_HOSTS, socket.gethostname()}


class HostfileError(ValueError):
    """What is wrong with a hostfile, by line number, never with the file's contents."""


def parse_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """[(host, slots)] in file order. Blank lines and lines starting with '#' are skipped (as DeepSpeed does)."""
    path = Path(path)
    try:
        if not path.is_file():
            raise HostfileError(f"hostfile {path} does not exist or is not a file")
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise HostfileError(f"hostfile {path} cannot be read ({type(exc).__name__})") from None
    if len(data) > MAX_BYTES:
        raise HostfileError(f"hostfile {path} is larger than {MAX_BYTES // 1024} KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise HostfileError(f"hostfile {path} is not UTF-8 text") from None
    hosts: list[tuple[str, int]] = []
    seen: dict[str, int] = {}
    allowed = allowed_hosts()
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = HOST_LINE.match(line)
        if match is None:
            raise HostfileError(f"hostfile {path}, line {number}: expected 'hostname slots=N'")
        host, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise HostfileError(f"hostfile {path}, line {number}: slots must be at least 1")
        if host in seen:
            raise HostfileError(f"hostfile {path}, line {number}: host already listed on line {seen[host]}")
        if host not in allowed:
            raise HostfileError(f"hostfile {path}, line {number}: not a machine the server's operator allows "
                                f"(this one, or one listed in {ALLOWED_HOSTS_ENV})")
        seen[host] = number
        hosts.append((host, slots))
    if not hosts:
        raise HostfileError(f"hostfile {path} lists no hosts")
    return hosts
