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


def spec_section(node: type, section: str, inputs: dict, read: dict[str, Callable] | None = None):
    """The run spec's section `section` (its table's name: "train") from `inputs`, the node's execute arguments:
    each field from the input input_names gives it, a choice's label read as its value, a value cast to the
    field's type; `read` maps a field to a function of the input's value where a cast is not enough (text to a
    list). An optional input a saved workflow lacks takes the schema's default; fields no input fills keep the
    dataclass's."""
    from ..trainer.spec import CHOICE_FIELDS, RunSpec, choice_value
    cls = type(getattr(RunSpec(), section))
    fields, defaults, values = {f.name: f for f in dataclasses.fields(cls)}, _schema_inputs(node), {}
    for dotted, name in input_names(node, section).items():
        field = dotted.split(".", 1)[1]
        value = inputs.get(name)
        if value is None:  # an optional input a saved workflow lacks (or not given by an API client)
            value = defaults[name]
            if value is None:
                continue
        if read and field in read:
            value = read[field](value)
        elif dotted in CHOICE_FIELDS:
            value = choice_value(CHOICE_FIELDS[dotted], value, name)
        else:
            value = _cast(fields[field], value)
        values[field] = value
    return cls(**values)


def _cast(f: dataclasses.Field, value):
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    return {"int": int, "float": float, "bool": bool, "str": str}.get(kind, lambda v: v)(value)


def input_names(node: type, *sections: str) -> dict[str, str]:
    """{"section.field": the node's input that fills it} over `sections` (the ones the node builds): the input of
    the field's name, or the one the node's SPEC_INPUTS names (None: none, though an input has its name). The one
    rule spec_section fills fields by, and the map that turns the spec's problems into errors naming the node's
    inputs (runner.node_run.NodeCall.refuse)."""
    from ..trainer.spec import RunSpec
    renamed, ids = getattr(node, "SPEC_INPUTS", {}), set(_schema_inputs(node))
    draft, names = RunSpec(), {}
    for section in sections:
        for f in dataclasses.fields(getattr(draft, section)):
            name = renamed.get(f"{section}.{f.name}", f.name)
            if name in ids:
                names[f"{section}.{f.name}"] = name
    return names
