"""What this installation wrote: a per-installation secret and HMAC-SHA256 signatures made with it.

ComfyUI has no authentication and any client can write any bytes under output/ (POST /upload/image with
type=output), so a run folder is trusted because it is signed, never because it is there. The secret lives
outside every folder ComfyUI's routes can write (output/, input/, user/, temp/): the file named by
$INGRAPH_SECRET_FILE, which a ComfyUI server sets to `secret` in its own data folder (runner/paths.py), so
two servers that share a home do not trust each other's runs; without it (the trainer run by hand)
~/.config/ingraph-trainer/secret ($XDG_CONFIG_HOME honoured), which servers before the data folder's secret
used too (`migrate_runs` re-signs their runs). The ComfyUI side and the trainer read the same file; on several
machines only rank 0 (the launching machine) signs and verifies, and broadcasts its verdict.

Standard library only, besides the cache's file checksum (itself standard library): both sides import it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
from pathlib import Path

from ...cache.files import atomic_write
from ...cache.shards import file_sha256  # the cache's shard checksum: one sha256-of-a-file in the pack

SECRET_ENV = "INGRAPH_SECRET_FILE"
RUN_SIGNATURE_FILE = "run.sig"  # HMAC over the run spec and the manifests the runner wrote
SIGNATURE_VERSION = 1
_SECRET_HEX_CHARS = 64
_cached: dict[str, bytes] = {}


class TrustError(ValueError):
    """Something under output/ that this installation did not write, or changed after writing it."""


def home_secret_path() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "ingraph-trainer" / "secret"


def secret_path() -> Path:
    configured = os.environ.get(SECRET_ENV)
    return Path(configured).expanduser() if configured else home_secret_path()


def installation_secret(path: Path | None = None) -> bytes:
    """The secret (of `path`, else the one in use), created (mode 0600, atomically: concurrent first users agree
    on one) on first use."""
    path = secret_path() if path is None else path
    key = str(path)
    if key not in _cached:
        if not path.exists():
            _create_secret(path)
        text = path.read_text(encoding="ascii", errors="replace").strip()
        if len(text) != _SECRET_HEX_CHARS or any(c not in "0123456789abcdef" for c in text):
            raise TrustError(f"{path}: not an InGraph Trainer secret (expected {_SECRET_HEX_CHARS} hex digits); "
                             f"delete it to make a new one (runs signed with the old one are no longer resumable)")
        _cached[key] = bytes.fromhex(text)
    return _cached[key]


def _create_secret(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secret-")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_hex(_SECRET_HEX_CHARS // 2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never replaces: whoever links first wins, the others read the winner's
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def sign(payload: bytes, secret: bytes | None = None) -> str:
    return hmac.new(installation_secret() if secret is None else secret, payload, hashlib.sha256).hexdigest()


def read_signed_json(path: Path, max_bytes: int = 16 << 20, secret: bytes | None = None) -> dict:
    """A JSON object {..., "hmac": ...} whose HMAC (over the rest, canonical) verifies with `secret` (else the
    secret in use); else TrustError."""
    if path.is_symlink() or not path.is_file():
        raise TrustError(f"{path} is missing")
    if path.stat().st_size > max_bytes:
        raise TrustError(f"{path} is too large to be a signature")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise TrustError(f"{path} is not a signature ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise TrustError(f"{path} is not a signature")
    body = {k: v for k, v in data.items() if k != "hmac"}
    signature = data.get("hmac")
    if not (isinstance(signature, str) and hmac.compare_digest(sign(canonical(body), secret), signature)):
        raise TrustError(f"{path} was not signed by this installation")
    return body


def write_signed_json(path: Path, body: dict):
    """Atomically (temp file + rename), so a reader never sees half a signature."""
    data = dict(body, hmac=sign(canonical(body)))
    with atomic_write(path, prefix=f".{path.name}-") as staged:
        staged.path.write_text(json.dumps(data, sort_keys=True, indent=1), encoding="utf-8")


def sign_run(run_dir: str | Path, names: list[str]):
    """Signs the files the runner wrote into a run directory (the spec and its manifests), bound to the run's id."""
    run_dir = Path(run_dir)
    files = {name: file_sha256(run_dir / name) for name in names}
    write_signed_json(run_dir / RUN_SIGNATURE_FILE, {"version": SIGNATURE_VERSION, "run": run_dir.name, "files": files})


def verify_run(run_dir: str | Path, required: str, held: dict[str, bytes] | None = None) -> None:
    """Raises TrustError unless the run's signature verifies and every signed file (`required` among them)
    still has the bytes that were signed. `held`: files already read, checked as read (not read again)."""
    run_dir = Path(run_dir)
    body = read_signed_json(run_dir / RUN_SIGNATURE_FILE)
    files = body.get("files")
    if body.get("version") != SIGNATURE_VERSION or body.get("run") != run_dir.name or not isinstance(files, dict) \
            or required not in files:
        raise TrustError(f"{run_dir / RUN_SIGNATURE_FILE} does not sign this run")
    for name, digest in files.items():
        path = run_dir / name
        if isinstance(name, str) and held and name in held:
            if hashlib.sha256(held[name]).hexdigest() != digest:
                raise TrustError(f"{path} changed after the run was signed")
            continue
        if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or path.is_symlink() \
                or not path.is_file() or file_sha256(path) != digest:
            raise TrustError(f"{path} changed after the run was signed")


def run_is_trusted(run_dir: str | Path, required: str) -> bool:
    try:
        verify_run(run_dir, required)
        return True
    except (TrustError, OSError):
        return False


def migrate_runs(roots: list[Path], old_secret: Path) -> int:
    """Re-signs, with the secret in use, what `old_secret` signed under `roots` (each run folder's run.sig and its
    checkpoints' COMPLETE marks): a server moving from the secret in the home folder to its data folder's keeps
    its own runs resumable. Whatever does not verify with the old secret is left as it is. Returns how many
    signatures were re-signed."""
    from .layout import CHECKPOINTS_DIR, COMPLETE_MARK
    old = installation_secret(old_secret)
    moved = 0
    for root in roots:
        runs = sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.is_symlink()) \
            if Path(root).is_dir() else []
        for run_dir in runs:
            marks = [run_dir / RUN_SIGNATURE_FILE] + sorted((run_dir / CHECKPOINTS_DIR).glob(f"*/{COMPLETE_MARK}"))
            for mark in marks:
                try:
                    body = read_signed_json(mark, secret=old)
                except (TrustError, OSError):
                    continue
                write_signed_json(mark, body)
                moved += 1
    return moved
