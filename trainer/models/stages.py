"""The pieces each family's pipeline layers share (ModelFamily.pipeline_layers): the first layer's turn of the stage
inputs into what the model's blocks take, the last layer's hold on tensors it carried but no longer needs, and the
carrying of a model's own nested block inputs (ComfyUI's LTX models prepare theirs in steps) across the stages."""
from __future__ import annotations

import enum
import importlib
import json

import torch

from .base import Batch


class StageInput(torch.nn.Module):
    """A family's first pipeline layer: stage inputs (latents, cond, noise, timesteps[, pooled][, references]) to
    what the model's blocks take. The family is kept out of the submodules: its model is split across the layers."""

    takes_references = False  # whether it hands the model the batch's reference images (pipeline.check_data)

    def __init__(self, family):
        super().__init__()
        self._family = [family]

    @property
    def family(self):
        return self._family[0]

    def model_inputs(self, inputs):
        """(x_in, timestep, kwargs) of the stage inputs (pipeline.micro_batch's): the pooled vector where present
        (an empty tensor holds its place before reference images), then the reference images."""
        latents, cond, noise, timesteps, *rest = inputs
        pooled = rest[0] if rest and rest[0].numel() else None
        references = list(rest[1:]) or None
        return self.family.model_inputs(Batch(latents, cond, pooled, noise, timesteps, references=references))

    @staticmethod
    def sendable(*tensors):
        """DeepSpeed sends a gradient back for every floating-point tensor that crosses a stage."""
        for tensor in tensors:
            tensor.requires_grad_(True)
        return tensors


def ends_here(output: torch.Tensor, *carried: torch.Tensor) -> torch.Tensor:
    """The last layer's output, with a zero-weighted use of tensors carried along but not needed any more, so
    that they get the (zero) gradient DeepSpeed sends back across stages."""
    return output + sum((t * 0).sum() for t in carried)  # each element zeroed first: a mask's -3.4e38s sum to -inf


def holding_all_but(layer: torch.nn.Module, model: torch.nn.Module, others: tuple[str, ...]) -> None:
    """`layer` holds (registers, so its stage places and optimises them) every direct part of `model` but the ones
    named: a first stage that runs the model's own preparation steps, which reach any of them."""
    for name, child in model.named_children():
        if name not in others:
            layer.add_module(name, child)
    for name, param in model.named_parameters(recurse=False):
        if name not in others:
            layer.register_parameter(name, param)


def packed(tree) -> tuple[torch.Tensor, ...]:
    """`tree` as what crosses a stage, which is tensors only: its tensors (each once), then a uint8 tensor of its
    structure (JSON) with the values that are not tensors. Takes nested lists, tuples and dicts of tensors, None,
    numbers, strings, enums, dtypes and objects of __slots__ (ComfyUI's CompressedTimestep); an empty tensor
    travels as its shape."""
    tensors, index = [], {}

    def encode(value):
        if isinstance(value, torch.Tensor):
            if value.numel() == 0:
                return {"empty": [list(value.shape), str(value.dtype).removeprefix("torch.")]}
            if id(value) not in index:
                index[id(value)] = len(tensors)
                tensors.append(value)
            return {"tensor": index[id(value)]}
        kind = [type(value).__module__, type(value).__qualname__]
        if isinstance(value, enum.Enum):  # before the numbers: an IntEnum is an int too
            return {"enum": [*kind, value.value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if type(value) in (list, tuple):
            return {type(value).__name__: [encode(v) for v in value]}
        if type(value) is dict:
            return {"dict": [[key, encode(v)] for key, v in value.items()]}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        slots = _slots(type(value))
        if slots and not isinstance(value, (list, tuple, dict)):  # a NamedTuple has empty slots: refused below
            return {"slots": [*kind, [[slot, encode(getattr(value, slot))] for slot in slots]]}
        raise TypeError(f"a {type(value).__name__} cannot cross a pipeline stage")

    structure = json.dumps(encode(tree)).encode()
    device = tensors[0].device if tensors else None
    return (*tensors, torch.tensor(list(structure), dtype=torch.uint8, device=device))


def unpacked(inputs: tuple[torch.Tensor, ...]):
    """What `packed` made of a tree, as the tree."""
    *tensors, structure = inputs

    def kind(module: str, qualname: str):
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        return found

    def decode(node):
        if not isinstance(node, dict):
            return node
        (what, body), = node.items()
        if what == "tensor":
            return tensors[body]
        if what == "empty":
            return torch.zeros(body[0], dtype=getattr(torch, body[1]), device=structure.device)
        if what in ("list", "tuple"):
            return (list if what == "list" else tuple)(decode(v) for v in body)
        if what == "dict":
            return {key: decode(v) for key, v in body}
        if what == "dtype":
            return getattr(torch, body)
        if what == "enum":
            return kind(*body[:2])(body[2])
        made = object.__new__(kind(*body[:2]))  # slots: filled as they were, not rebuilt
        for slot, value in body[2]:
            setattr(made, slot, decode(value))
        return made

    return decode(json.loads(bytes(structure.tolist()).decode()))


def _slots(cls) -> list[str]:
    """Every slot of `cls` and its bases (a class may give one name as a string)."""
    names = []
    for base in cls.__mro__:
        own = base.__dict__.get("__slots__", ())
        names += [own] if isinstance(own, str) else [n for n in own if n not in ("__weakref__", "__dict__")]
    return names


def floats(inputs) -> list[torch.Tensor]:
    """The floating-point tensors among a stage's inputs: those DeepSpeed receives as requiring grad."""
    return [t for t in inputs if t.is_floating_point()]
