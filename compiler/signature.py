"""Signatures: everything a cost measurement depends on, as a hashable value (``compiler/measured.py`` keeps
measurements by them).

A node's signature (``cost._Measure._signature``) is its op and its arguments as ``describe`` sees them; a
pack's (``pack_signature``) is each of its nodes, inputs and state tensors; a graph's (``graph_signature``) is
its nodes' signatures and wiring. Two nodes, packs or graphs with equal signatures measure the same, so the
24 blocks of a GPT are measured once. What cannot be described (``Unknown``) is measured afresh.
"""
from __future__ import annotations

import torch
import torch.fx

from harmony.compiler.fake import FakeRun

_CONSTANTS = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class Unknown(Exception):
    """An argument or module setting a signature cannot describe."""


def describe(x, node, storages: dict, is_state) -> tuple:
    """An argument as a measurement sees it, hashable: constants as they are; tensors by shape, dtype, layout,
    storage size, whether they need a gradient or are a parameter or buffer (``is_state(storage id)``), and
    which share a storage (``storages``: id -> first seen); graph nodes as ``node(n)`` names them. Anything
    else raises ``Unknown``."""
    if isinstance(x, torch.fx.Node):
        return ("node",) + tuple(node(x))
    if isinstance(x, torch.Tensor):
        st = x.untyped_storage()
        return ("tensor", tuple(x.shape), x.dtype, x.device.type, tuple(x.stride()), x.storage_offset(), st.nbytes(),
                x.requires_grad, is_state(id(st)), storages.setdefault(id(st), len(storages)))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__,) + tuple(describe(v, node, storages, is_state) for v in x)
    if isinstance(x, dict):
        return ("dict",) + tuple((k, describe(v, node, storages, is_state)) for k, v in x.items())
    if isinstance(x, slice):
        return ("slice",) + tuple(describe(v, node, storages, is_state) for v in (x.start, x.stop, x.step))
    if x is None or isinstance(x, _CONSTANTS):
        return (type(x), x)
    raise Unknown


def pack_signature(module: torch.fx.GraphModule, inputs: list, grad_inputs: list[bool], run: FakeRun,
                   loss_output: bool, keep: bool) -> tuple | None:
    """Everything ``pack_cost.measure_pack`` depends on, or None where that cannot be told: each node of the pack's
    graph (its op, as ``cost._Measure._signature``, and its arguments, other nodes by position), the inputs and
    the state tensors it reads as ``describe`` sees them. Packs of the same layers at other depths match."""
    at = {n: i for i, n in enumerate(module.graph.nodes)}
    storages: dict = {}
    feed = iter(zip(inputs, grad_inputs))

    def desc(x):    # the pack measures its inputs and state alike (leaves), so "state" is not told apart
        return describe(x, lambda n: (at[n],), storages, lambda st: False)
    try:
        items = []
        for n in module.graph.nodes:
            if n.op == "placeholder":
                value, grad = next(feed)
                items.append(("input", desc(value), grad))
            elif n.op == "get_attr":
                items.append(("state", desc(getattr_path(module, n.target))))
            elif n.op == "call_module":
                mod = module.get_submodule(n.target)
                items.append((n.op, module_signature(mod), desc(list(mod.state_dict(keep_vars=True).values())),
                              desc((n.args, n.kwargs))))
            else:
                items.append((n.op, n.target, desc((n.args, n.kwargs))))
        return tuple(items), loss_output, keep, run.dtype
    except Unknown:
        return None


def module_signature(mod: torch.nn.Module) -> tuple:
    """A leaf module as its measurement sees it: every submodule's class, public settings and state shapes.
    A module with hooks, or a public attribute that is not a constant, is not described (``Unknown``)."""
    out = []
    for name, m in mod.named_modules():
        settings = []
        for k, v in vars(m).items():
            if k.startswith("_"):
                if "hook" in k and v:
                    raise Unknown
            elif v is None or isinstance(v, _CONSTANTS) or (isinstance(v, tuple) and all(
                    isinstance(x, _CONSTANTS) for x in v)):
                settings.append((k, v))
            else:
                raise Unknown
        state = tuple((k, tuple(t.shape), t.dtype, getattr(t, "requires_grad", False))
                      for k, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None)
        out.append((name, type(m), tuple(settings), state))
    return tuple(out)


def graph_signature(gm: torch.fx.GraphModule, signatures: dict, b2: int) -> tuple | None:
    """Everything the run at the second microbatch size ``b2`` depends on, or None where that cannot be told: each
    node's signature at the first size (``_Measure._signature``: its op and how its inputs look) and where its
    inputs are in the graph. The placeholders' shapes at ``b2`` follow from theirs at the first size."""
    at = {n: i for i, n in enumerate(gm.graph.nodes)}
    items = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            items.append((n.op, tuple(at[a] for a in n.all_input_nodes)))
            continue
        if signatures.get(n) is None:
            return None
        items.append((signatures[n], tuple(at[a] for a in n.all_input_nodes)))
    return b2, tuple(items)


def getattr_path(obj, target: str):
    """``obj``'s attribute at the dotted path ``target`` (a get_attr node's)."""
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
