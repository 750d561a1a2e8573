"""Which nodes of a model graph view which memory, and the op a write through a view becomes.

A node whose fake value shares memory with its first input is a view of it (``narrow``, ``x[:, :4]``,
``aten.slice``, ``split`` and the ``getitem`` of one of its parts, ``view``, ``transpose``); following views back
reaches the node that made the memory, the view's *root*, by a chain of *steps* (the view nodes, in order).
``functionalize_inplace`` (compiler/trace/inplace.py) turns a write through such a chain into
``write_through_view``: the root rewritten as a new tensor. It replays the user's own view ops on a clone of the
root and runs the user's own in-place op on that view, so forward and backward are eager's to the bit (autograd
records the same ``CopySlices`` eager records, after a ``clone`` whose backward passes the gradient on).

Example::

    >>> base = torch.zeros(2, 4)
    >>> write_through_view(base, (("aten.slice.Tensor", (1, 0, 2), {}),), "copy_", torch.ones(2, 2))
    tensor([[1., 1., 0., 0.],
            [1., 1., 0., 0.]])
    >>> base.sum()
    tensor(0.)
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Callable

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Alias", "alias_map", "op_name", "write_through_view"]


def write_through_view(base: torch.Tensor, views: tuple, op: str, *args, **kwargs) -> torch.Tensor:
    """``base`` as it is after ``op(view, *args, **kwargs)`` writes into the view that ``views`` (``(name, args,
    kwargs)`` steps) make of it, as a new tensor; ``base`` is not written. Names are Tensor methods (``"narrow"``,
    ``"__getitem__"``, ``"copy_"``) or ATen overloads (``"aten.slice.Tensor"``)."""
    out = base.clone()
    view = out
    for name, step_args, step_kwargs in views:
        view = _call(name, view, step_args, step_kwargs)
    _call(op, view, args, kwargs)
    return out


def _call(name: str, tensor, args, kwargs):
    if "." in name:
        return _overload(name)(tensor, *args, **kwargs)
    return getattr(tensor, name)(*args, **kwargs)


@functools.cache
def _overload(name: str) -> torch._ops.OpOverload:
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def op_name(node: torch.fx.Node) -> str | None:
    """How ``write_through_view`` names the op ``node`` calls on its first argument (a Tensor method or an ATen
    overload), or None where it has no such name (a module, ``F.relu(x, inplace=True)``)."""
    target = node.target
    if node.op == "call_method":
        return target
    if node.op != "call_function":
        return None
    if isinstance(target, torch._ops.OpOverload):
        return str(target)                   # "aten.slice.Tensor"
    if target is operator.getitem:
        return "__getitem__"
    name = getattr(target, "__name__", "")
    if target in _OPERATOR_METHODS:
        name = f"__{name}__"                 # operator.iadd -> Tensor.__iadd__
    elif getattr(torch, name, None) is not target:
        return None                          # only torch.narrow, torch.relu_, ...: the Tensor method of that name
    return name if callable(getattr(torch.Tensor, name, None)) else None


_OPERATOR_METHODS = {getattr(operator, f"i{name}") for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")}


@dataclasses.dataclass(frozen=True)
class Alias:
    """Where a node's value lives: in the memory ``root`` made, seen through the view nodes ``steps`` (none: the
    root's own value); ``steps`` is None where a view in between cannot be replayed (a module's output)."""

    root: torch.fx.Node
    steps: tuple[torch.fx.Node, ...] | None = ()


def alias_map(graph: torch.fx.Graph, written: Callable[[torch.fx.Node], torch.fx.Node | None]) -> dict:
    """node -> ``Alias`` for every node whose fake value is a tensor (or holds tensors, as ``split``'s does); an
    in-place write (``written(node)``: the node it writes, else None) aliases the tensor it writes. Nodes
    without a fake value are left out: nothing can be told of them."""
    aliases: dict[torch.fx.Node, Alias] = {}
    for node in graph.nodes:
        mine = _storages(node)
        if not mine:
            continue
        target = written(node)
        if target is not None:               # a write returns the tensor it writes
            if target in aliases:
                aliases[node] = aliases[target]
            continue
        aliases[node] = Alias(node)
        for source in node.all_input_nodes:
            if source not in aliases or not mine & _storages(source):
                continue
            parent = aliases[source]
            if not isinstance(parent.root.meta.get("val"), torch.Tensor):
                break                        # a part of a multi-output op (layer norm's mean): memory of its own
            replayable = parent.steps is not None and node.args[:1] == (source,) and op_name(node) is not None
            aliases[node] = Alias(parent.root, parent.steps + (node,) if replayable else None)
            break
    return aliases


def _storages(node: torch.fx.Node) -> set:
    """The memory (storage addresses) of ``node``'s fake value: one for a tensor, each part's for a list."""
    val = node.meta.get("val")
    values = val if isinstance(val, (list, tuple)) else (val,)
    out = set()
    for v in values:
        if isinstance(v, torch.Tensor) and v.layout == torch.strided:
            try:
                out.add(StorageWeakRef(v.untyped_storage()).cdata)
            except (RuntimeError, NotImplementedError):   # a tensor subclass without storage
                pass
    return out
