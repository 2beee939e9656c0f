"""From a node's inputs to the run spec's sections: one rule for every node. An input fills the spec field of its
own name, or the field a node's SPEC_INPUTS map names it for; a choice's label becomes the spec's value
(trainer.spec.CHOICE_FIELDS), a value is cast to the field's type, and an optional input a saved workflow lacks
takes the schema's default. So a new input is its schema entry (and a spec field): nothing else carries it."""
from __future__ import annotations

import dataclasses
from typing import Callable


_SCHEMA_INPUTS: dict[tuple[str, str], dict] = {}


def _schema_inputs(node: type) -> dict:
    """{input id: its default or None} of the node's schema, asked once a node class (defaults and ids are written
    in the code; a schema lists files too). Keyed by the class's module and qualified name, which the clone ComfyUI
    makes of it for every run keeps (PREPARE_CLASS_CLONE)."""
    key = (node.__module__, node.__qualname__)
    if key not in _SCHEMA_INPUTS:
        _SCHEMA_INPUTS[key] = {i.id: getattr(i, "default", None) for i in node.define_schema().inputs}
    return _SCHEMA_INPUTS[key]


def schema_defaults(node: type) -> dict:
    """{input id: default} of the node's schema, for the inputs that have one."""
    return {name: default for name, default in _schema_inputs(node).items() if default is not None}


def spec_section(node: type, section: str, cls: type, inputs: dict, read: dict[str, Callable] | None = None):
    """The spec section `cls` (named `section`, as the spec's tables are) from `inputs`, the node's execute
    arguments. `node.SPEC_INPUTS` maps "section.field" to the input that fills it where the names differ (None: no
    input of the node fills that field, though one has its name); `read` maps a field to a function of the
    input's value where a cast is not enough (text to a list). Fields no input fills keep the dataclass's default."""
    from ..trainer.spec import CHOICE_FIELDS, choice_value
    renamed, defaults = getattr(node, "SPEC_INPUTS", {}), schema_defaults(node)
    values = {}
    for f in dataclasses.fields(cls):
        dotted = f"{section}.{f.name}"
        name = renamed.get(dotted, f.name)
        if name is None or (name not in inputs and name not in defaults):
            continue
        value = inputs.get(name)
        if value is None:  # an optional input a saved workflow lacks (or not given by an API client)
            value = defaults.get(name)
            if value is None:
                continue
        if read and f.name in read:
            value = read[f.name](value)
        elif dotted in CHOICE_FIELDS:
            value = choice_value(CHOICE_FIELDS[dotted], value, name)
        else:
            value = _cast(f, value)
        values[f.name] = value
    return cls(**values)


def _cast(f: dataclasses.Field, value):
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    return {"int": int, "float": float, "bool": bool, "str": str}.get(kind, lambda v: v)(value)


def input_names(node: type, *sections: str) -> dict[str, str]:
    """{"section.field": the node's input that fills it} over `sections` (the ones the node builds): the map that
    turns the spec's problems into errors naming the node's inputs (runner.node_run.NodeCall.refuse)."""
    from ..trainer.spec import RunSpec
    renamed, ids = getattr(node, "SPEC_INPUTS", {}), set(_schema_inputs(node))
    draft, names = RunSpec(), {}
    for section in sections:
        for f in dataclasses.fields(getattr(draft, section)):
            name = renamed.get(f"{section}.{f.name}", f.name)
            if name in ids:
                names[f"{section}.{f.name}"] = name
    return names
