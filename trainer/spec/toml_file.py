"""A run spec as a file: run.toml read (from the bytes, which the trainer checks the signature of) into a
validated RunSpec, every field's type checked and named, and written back as TOML."""
from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any, get_type_hints

from .run_spec import RunSpec
from .sections import RunSpecError


def _from_dict(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise RunSpecError(f"{where}: expected a table")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise RunSpecError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, hint, path = data[f.name], hints[f.name], f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(hint):
            value = _from_dict(hint, value, path)
        elif hint is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif hint in (int, float, str, bool, list) and not (
                isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
            raise RunSpecError(f"{path}: expected {hint.__name__}, got {type(value).__name__} {_short(value)}")
        if hint is float and not math.isfinite(value):
            raise RunSpecError(f"{path}: must be a finite number (got {value})")
        kwargs[f.name] = value
    return cls(**kwargs)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def spec_from_dict(data: dict, source: str = "run spec") -> RunSpec:
    try:
        spec = _from_dict(RunSpec, data, "")
    except RunSpecError as exc:
        raise RunSpecError(f"{source}: {exc}") from None
    return spec.validate(source)


def load_run_spec(path: str | Path) -> RunSpec:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RunSpecError(f"{path}: run spec not found") from None
    return parse_run_spec(raw, str(path))


def parse_run_spec(raw: bytes, source: str) -> RunSpec:
    """A spec from the bytes already read (the trainer checks the signature of exactly these bytes)."""
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RunSpecError(f"{source}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise RunSpecError(f"{source}: not valid TOML ({exc})") from None
    except RecursionError:
        raise RunSpecError(f"{source}: nested too deeply") from None
    return spec_from_dict(data, source)


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cannot write the non-finite number {value} to a run spec")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_TOML_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7f else ch)
                             for ch in value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_run_spec(spec: RunSpec) -> str:
    lines, tables = [], []
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if dataclasses.is_dataclass(value):
            tables.append((f.name, value))
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    for name, table in tables:
        lines.append(f"\n[{name}]")
        for f in dataclasses.fields(table):
            lines.append(f"{f.name} = {_toml_value(getattr(table, f.name))}")
    return "\n".join(lines) + "\n"
