"""In-place writes to activations, rewritten out of place in the model graph.

``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``, ``out += identity`` and ``x /= s``
overwrite a tensor another node made. Harmony cuts the graph into packs, measures each node
alone on leaf inputs, stashes a pack's inputs for its backward and recomputes forwards from
them; an in-place write breaks each of those (a leaf that needs a gradient cannot be written;
a stashed input would hold the overwritten value). So ``functionalize_inplace`` turns each
such write into its out-of-place twin (``relu_`` -> ``relu``, ``iadd`` -> ``add``, a module's
``inplace=True`` -> an ``inplace=False`` copy of it) and points every later reader of the
written tensor at the result. The values are the same bits, forward and backward (autograd
saves the same tensors for both forms); the cost is one more activation where eager reused
the memory, which the cost model then counts.

Writes into the training state (BatchNorm's running statistics, ``num_batches_tracked``) are
left alone: the runtime applies them to the state; so are writes no gradient flows through (T5's
``_shift_right`` builds the decoder's token ids by writing into slices of a zero tensor): autograd
never sees them. A write whose tensor is also read through
another view later (``y = x.view(...); x.relu_(); use(y)``) cannot be rewritten this way; it
raises a ``TraceError`` naming the op and its source line.
"""
from __future__ import annotations

import copy
import inspect
import operator
import re

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from harmony.base.errors import TraceError
from harmony.compiler.meta import MODULE_PATH
from harmony.compiler.trace.errors import is_library

__all__ = ["functionalize_inplace", "inplace_error", "source_of"]

_OPERATORS = {getattr(operator, f"i{name.rstrip('_')}"): getattr(operator, name) for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and_", "or_", "xor", "lshift", "rshift", "matmul")}


def functionalize_inplace(gm: torch.fx.GraphModule) -> int:
    """Rewrite in place the in-place writes to activations in ``gm``'s graph; returns how many were rewritten."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    state = _state_storages(gm.graph)
    grad = _carries_gradient(gm)
    rewritten = 0
    twins: dict[str, str] = {}           # target of an in-place module -> its out-of-place copy
    for node in list(gm.graph.nodes):
        rewrite = _out_of_place(gm, node)
        if rewrite is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        written = node.args[0]
        if written.op == "get_attr" or _storage(written) in state:
            continue                     # the training state: the runtime applies the write
        if not grad[node]:
            continue                     # no gradient flows through it (token ids, masks): nothing to plan
        aliases = _later_readers_of_aliases(written, node, order)
        if aliases is None:              # no fake values to tell aliases by: leave it to the cost model
            continue
        if aliases:
            raise TraceError(
                f"in-place {_op_name(node)} at {source_of(node)} writes a tensor that {aliases[0].name} reads "
                f"afterwards through another view of the same memory; Harmony trains graphs without in-place "
                f"writes to activations and cannot rewrite this one. Write it out of place (y = x.relu(), "
                f"x = x + y) or put the module that does it in leaf_modules")
        rewrite(twins)
        for user in list(written.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(written, node)
        node.meta["val"] = _fresh(node.meta.get("val"))
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _out_of_place(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """A function that makes ``node`` its out-of-place twin, or None if ``node`` writes none of its inputs."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        functional = _functional_overload(target)
        return None if functional is None else lambda twins: setattr(node, "target", functional)
    if node.op == "call_function" and target in _OPERATORS:
        return lambda twins: setattr(node, "target", _OPERATORS[target])
    if node.op == "call_function" and callable(target) and _inplace_argument(node):
        return lambda twins: _bind_inplace_false(node)
    if node.op == "call_method" and _functional_method(target) is not None:
        return lambda twins: setattr(node, "target", _functional_method(target))
    if node.op == "call_module":
        module = gm.get_submodule(target)
        if getattr(module, "inplace", False) is True and not [*module.parameters(), *module.buffers()]:
            return lambda twins: setattr(node, "target", _twin(gm, target, module, twins))
    return None


def _functional_overload(op: torch._ops.OpOverload):
    schema = op._schema
    writes = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    name = op._opname
    if not writes or writes[0] is not schema.arguments[0] or not name.endswith("_") or name.startswith("_"):
        return None
    functional = getattr(getattr(torch.ops.aten, name[:-1], None), op._overloadname, None)
    if functional is None or functional._schema.is_mutable:
        return None
    return functional


def _functional_method(name) -> str | None:
    if not isinstance(name, str) or not name.endswith("_") or name.startswith("_"):
        return None
    base = name[:-1]
    return base if callable(getattr(torch.Tensor, base, None)) else None


def _inplace_argument(node: torch.fx.Node) -> bool:
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("inplace") is True


def _bind_inplace_false(node: torch.fx.Node) -> None:
    bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    bound.arguments["inplace"] = False
    node.args, node.kwargs = tuple(bound.args), dict(bound.kwargs)


def _twin(gm: torch.fx.GraphModule, target: str, module: torch.nn.Module, twins: dict[str, str]) -> str:
    """An ``inplace=False`` copy of a stateless module, installed once at the top of ``gm`` (never the user's)."""
    if target not in twins:
        twin = copy.copy(module)
        twin.inplace = False
        name, i = "_harmony_out_of_place_" + target.replace(".", "_"), 0
        while hasattr(gm, f"{name}_{i}" if i else name):
            i += 1
        name = f"{name}_{i}" if i else name
        gm.add_module(name, twin)
        twins[target] = name
    return twins[target]


def _carries_gradient(gm: torch.fx.GraphModule) -> dict:
    """node -> whether autograd tracks its value: a float result of a node that reads a parameter that needs a
    gradient, directly or through other nodes (the fake values themselves do not say)."""
    grad = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm.get_submodule(node.target.rpartition(".")[0]), node.target.rpartition(".")[2], None)
            grad[node] = isinstance(value, torch.nn.Parameter) and value.requires_grad
            continue
        val = node.meta.get("val")
        own = node.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(node.target).parameters())
        floating = not isinstance(val, torch.Tensor) or val.is_floating_point() or val.is_complex()
        grad[node] = floating and (own or any(grad.get(a, False) for a in node.all_input_nodes))
    return grad


def _storage(node: torch.fx.Node) -> int | None:
    """The address of the memory ``node``'s fake value lives in (views share it); None without a value."""
    val = node.meta.get("val")
    return StorageWeakRef(val.untyped_storage()).cdata if isinstance(val, torch.Tensor) else None


def _state_storages(graph: torch.fx.Graph) -> set:
    return {s for n in graph.nodes if n.op == "get_attr" and (s := _storage(n)) is not None}


def _later_readers_of_aliases(written: torch.fx.Node, node: torch.fx.Node, order: dict) -> list | None:
    """Nodes after ``node`` that read ``written``'s memory through another node (a view, or a base it views);
    None where the graph carries no fake values to tell."""
    storage = _storage(written)
    if storage is None:
        return None
    readers = []
    for other in node.graph.nodes:
        if other is written or other is node or order[other] >= order[node] or _storage(other) != storage:
            continue
        readers += [u for u in other.users if order[u] > order[node]]
    return readers


def _fresh(val):
    """A fake value like ``val`` in memory of its own (the rewritten node no longer aliases its input)."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return val
    with mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def inplace_error(node: torch.fx.Node | None, error: Exception) -> TraceError | None:
    """The error for an in-place write the analysis could not run (one left in place: into a parameter, or where
    the graph had no fake values to check aliases by), naming the op and its line; None for any other error."""
    text = str(error)
    if node is None or "in-place" not in text and "inplace" not in text:
        return None
    return TraceError(
        f"in-place {_op_name(node)} at {source_of(node)} cannot be planned: {type(error).__name__}: "
        f"{text.splitlines()[0]}. Write it out of place (y = x.relu(), x = x + y), or put the module that does it "
        f"in leaf_modules")


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.target} ({type(node.graph.owning_module.get_submodule(node.target)).__name__})"
    return getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else f".{node.target}()"


def source_of(node: torch.fx.Node) -> str:
    """The user's source line that made ``node`` ("file:line in function: code"), else its module path."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        frame = _FRAME.match(lines[i].strip())
        if frame and not is_library(frame["file"]):
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1].strip()) else ""
            return f"{frame['file']}:{frame['line']} in {frame['function']}" + (f": {code}" if code else "")
    return f"module {node.meta.get(MODULE_PATH) or '(top level)'!r}"


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
