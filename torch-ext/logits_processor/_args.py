"""Arguments as the ops take them, named as in their schemas (torch_binding.cpp).

The bottom of the package: it imports nothing of its own but the generated `_ops`. A parameter
that is "a number or a per-row tensor" travels as two schema arguments, `<name>` (the tensor,
or None) and `<name>_value` (the number; 0 with a tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch

from ._ops import ops as _registered_ops

Param = Union[float, int, torch.Tensor]
Flag = Union[bool, torch.Tensor]
Indices = Union[Sequence[int], torch.Tensor, None]
Rows = Indices  # indices of rows of the penalty state

def number_or_tensor(name: str, value: Param, kind: type) -> dict:
    """`value` as the schema arguments `<name>` and `<name>_value`."""
    if isinstance(value, torch.Tensor):
        return {name: value, f"{name}_value": kind(0)}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a 1-D tensor, got {type(value).__name__}")
    if kind is int and not isinstance(value, int):
        raise TypeError(f"{name} must be an int or an integer tensor, got {value!r}")
    return {name: None, f"{name}_value": kind(value)}


def flag_or_tensor(name: str, value: Flag) -> dict:
    """`value`, a bool or a per-row bool tensor (the op checks it), as the schema arguments `<name>`
    and `<name>_value`."""
    if isinstance(value, torch.Tensor):
        return {name: value, f"{name}_value": False}
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or a 1-D bool tensor, got {type(value).__name__}")
    return {name: None, f"{name}_value": value}


def indices_tensor(indices: Indices, name: str = "indices") -> Optional[torch.Tensor]:
    """None, or row indices as an int64 tensor (range checks happen in the op)."""
    if indices is None:
        return None
    if isinstance(indices, torch.Tensor):
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {indices.dtype}")
        return indices.to(torch.int64)
    if not isinstance(indices, Sequence) or isinstance(indices, str):
        raise TypeError(f"{name} must be a sequence of ints or an integer tensor, got {type(indices).__name__}")
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not -(2**63) <= i < 2**63]
    if bad:
        raise TypeError(f"{name} must hold int64 values, got {bad[0]!r}")
    return torch.tensor(list(indices), dtype=torch.int64)


def token_ids_dtype(ids_dtype: torch.dtype) -> torch.dtype:
    """`ids_dtype`, checked: the dtype the sampler ops write token ids in (int64 or int32)."""
    if ids_dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids_dtype must be torch.int64 or torch.int32, got {ids_dtype!r}")
    return ids_dtype


_ARGUMENT_NAMES: dict[str, tuple[str, ...]] = {}


def argument_names(op_name: str) -> tuple[str, ...]:
    """The names of the op's arguments, in its schema's order."""
    if op_name not in _ARGUMENT_NAMES:
        _ARGUMENT_NAMES[op_name] = tuple(a.name for a in getattr(_registered_ops, op_name).default._schema.arguments)
    return _ARGUMENT_NAMES[op_name]


# torch.compile runs it while tracing, as Python: what torch.compiler.assume_constant_result
# sets (torch 2.10 to 2.14), without the decorator's import of torch._dynamo, which made loading
# this package 1.5 s longer (tests/ops/test_replay.py compiles a call with fullgraph=True).
argument_names._dynamo_marked_constant = True


def call(ops, op_name: str, *outputs: torch.Tensor, **arguments) -> None:
    """`ops.<op_name>` with its schema's arguments given by name, then `outputs`: an `out`
    named tuple's fields, which are the schema's last arguments in their order (so a tuple of
    the wrong length gets torch's own message, naming the missing argument).

    The arguments are passed in the schema's order, not as keywords: `ops` is the calling
    module's namespace, which tests/planted_defects.py replaces by stand-ins that take
    positional arguments."""
    # A plain loop: torch 2.11's Dynamo cannot trace itertools.takewhile (a graph break, so
    # torch.compile(fullgraph=True) failed there; 2.14's can).
    values = []
    for name in argument_names(op_name):
        if name not in arguments:
            break
        values.append(arguments.pop(name))
    if arguments:
        raise TypeError(f"{op_name}: {next(iter(arguments))!r} is not the next argument of its schema")
    getattr(ops, op_name)(*values, *outputs)
