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

A write through a view (``q[..., :4] = q_nope`` into a ``new_empty`` buffer, as multi-head latent
attention builds its queries; ``h.narrow(1, 0, 2).copy_(y)``, ``h[:, 0].masked_fill_(m, 0)``, ``v.add_(y)``
for ``v = h[:, :2]``) writes the memory of the tensor it views, and every later reader of that memory, through
whichever view, reads the write. It is functionalized as torch.export and AOTAutograd do: the write becomes a new
value of the viewed tensor, its *root* (``views.write_through_view``: the user's views and op replayed on a
clone of the root), and each later reader of the memory reads the new root, or the same view ops replayed on
it. Where nothing but the written view is read afterwards, the write is its twin on the view, as above.

Writes into the training state (BatchNorm's running statistics, ``num_batches_tracked``) are
left alone: the runtime applies them to the state; so are writes into memory no write that carries a gradient
reaches (T5's ``_shift_right`` builds the decoder's token ids by writing into slices of a zero tensor): autograd
never sees them. A write that cannot be planned (through a view only a module's own code makes; an in-place op
that changes a view's shape) raises a ``TraceError`` naming the op and its source line.
"""
from __future__ import annotations

import collections
import copy
import inspect
import operator
import re

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from harmony.base.errors import TraceError
from harmony.compiler.meta import MODULE_PATH
from harmony.compiler.trace.errors import is_library
from harmony.compiler.trace.views import Alias, alias_map, op_name, write_through_view

__all__ = ["InPlaceProxy", "functionalize_inplace", "inplace_error", "source_of"]

_OPERATORS = {getattr(operator, f"i{name.rstrip('_')}"): getattr(operator, name) for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and_", "or_", "xor", "lshift", "rshift", "matmul")}
# Methods named as writes that write no values, and writes that change a view's shape rather than its values.
_NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad_"}
_RESHAPES = {"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_",
             "swapdims_", "swapaxes_", "detach_"}


class InPlaceProxy(torch.fx.Proxy):
    """The fx front end's ``Proxy``: it records ``x += y`` as ``operator.iadd(x, y)`` (and ``-=``, ``*=``, ...).
    ``torch.fx.Proxy`` has no in-place operators, so Python runs ``x = x + y`` instead and the trace loses the
    write into ``x``'s memory, which a view shares with another tensor (``w = h[:, 4:]; w *= 2`` scales ``h``);
    recorded, ``functionalize_inplace`` plans it as eager runs it."""


def _augmented(op):
    def method(self, other):
        return self.tracer.create_proxy("call_function", op, (self, other), {})
    method.__name__ = f"__{op.__name__}__"
    return method


for _op in _OPERATORS:
    setattr(InPlaceProxy, f"__{_op.__name__}__", _augmented(_op))


def functionalize_inplace(gm: torch.fx.GraphModule) -> int:
    """Rewrite in place the in-place writes to activations in ``gm``'s graph; returns how many were rewritten."""
    grad = _carries_gradient(gm)
    aliases = alias_map(gm.graph, lambda n: _written(gm, n))
    state = _state_storages(gm.graph)
    planned = set()     # roots whose writes are rewritten: one carries a gradient, or is an augmented assignment
    for node in gm.graph.nodes:
        written = _written(gm, node)
        if written in aliases and (grad[node] or node.target in _OPERATORS):
            root = aliases[written].root
            if root.op != "get_attr" and _storage(root) not in state:
                planned.add(root)
    if not planned:
        return 0
    rewritten = _Functionalizer(gm, aliases, planned).run()
    gm.graph.lint()
    gm.recompile()
    return rewritten


class _Functionalizer:
    """One walk over the graph in order. Each root (``views.Alias``) has a current value, the node that holds its
    memory as written so far, and a version, how many writes it has taken; a node that reads an alias made at an
    older version reads it replayed on the current value instead (the view nodes copied, once per version)."""

    def __init__(self, gm: torch.fx.GraphModule, aliases: dict, planned: set):
        self.gm, self.graph, self.aliases, self.planned = gm, gm.graph, aliases, planned
        self.order = {node: i for i, node in enumerate(gm.graph.nodes)}
        self.last_read = {node: max((self.order[u] for u in node.users), default=-1) for node in gm.graph.nodes}
        self.members = collections.defaultdict(list)     # root -> the original nodes in its memory
        for node, alias in aliases.items():
            self.members[alias.root].append(node)
        self.current: dict = {}
        self.version: collections.Counter = collections.Counter()
        self.made_at: dict = {}          # alias node -> its root's version when it was made
        self.replayed: dict = {}         # (view node, version) -> that view replayed on the root at that version
        self.last_write: dict = {}       # root -> the write that made its current value
        self.twins: dict[str, str] = {}  # target of an in-place module -> its out-of-place copy
        self.replaced: list = []

    def run(self) -> int:
        rewritten = 0
        for node in list(self.graph.nodes):
            written = _written(self.gm, node)
            alias = self.aliases.get(written)
            if alias is not None and alias.root in self.planned:
                self._write(node, written, alias)
                rewritten += 1
                continue
            self._refresh(node)
            if (alias := self.aliases.get(node)) is not None:
                self.made_at[node] = self.version[alias.root]
        for node in reversed(self.replaced):
            self.graph.erase_node(node)
        for node in reversed(list(self.graph.nodes)):     # views no one reads any more (pure: nothing else runs)
            alias = self.aliases.get(node)
            if not node.users and alias is not None and alias.steps and alias.root in self.planned:
                self.graph.erase_node(node)
        return rewritten

    def _write(self, node: torch.fx.Node, written: torch.fx.Node, alias: Alias) -> None:
        self.last_write[alias.root] = node
        if alias.steps is None:
            raise _unplannable(node, f"it writes through {written.name}, a view of another tensor that "
                                     f"{_op_name(_unreplayable(self.aliases, written))} makes and Harmony cannot "
                                     f"replay")
        if not alias.steps:
            self._refresh(node)
            rewrite = _out_of_place(self.gm, node)
            if rewrite is None:
                self._through(node, alias)
                return
            rewrite(self.twins)
            node.meta["val"] = _fresh(node.meta.get("val"))
            self._advance(alias.root, node)
        elif not self._others_read_after(node, written, alias.root) and _out_of_place(self.gm, node) is not None:
            self._refresh(node)          # nothing reads the memory afterwards but through this view: a twin
            _out_of_place(self.gm, node)(self.twins)
            node.meta["val"] = _fresh(node.meta.get("val"))
            for user in list(written.users):
                if user is not node and self.order.get(user, -1) > self.order[node]:
                    user.replace_input_with(written, node)
            self.aliases[node] = Alias(node)
            self.planned.add(node)
            self.made_at[node] = 0
        else:
            self._through(node, alias)

    def _through(self, node: torch.fx.Node, alias: Alias) -> None:
        """Replace the write ``node`` with ``write_through_view`` of its root's current value."""
        root, name = alias.root, op_name(node)
        if name is not None and name.split(".")[-2 if "." in name else -1] in _RESHAPES:   # aten.t_.default: t_
            raise _unplannable(node, "it changes the shape of a view of another tensor")

        def now(n):
            return self._now(n, node)
        with self.graph.inserting_before(node):
            args, kwargs = torch.fx.map_arg((node.args[1:], node.kwargs), now)
            if name is None:             # a module or an inplace=True function: its twin on the view, copied in
                view = self._replay(alias, node, node.args[0])
                twin = self.graph.node_copy(node, lambda n: view if n is node.args[0] else now(n))
                rewrite = _out_of_place(self.gm, twin)
                if rewrite is None:
                    raise _unplannable(node, "it has no out-of-place form")
                rewrite(self.twins)
                twin.meta["val"] = _fresh(node.meta.get("val"))
                name, args, kwargs = "copy_", (twin,), {}
            steps = torch.fx.map_arg(tuple((op_name(s), s.args[1:], dict(s.kwargs)) for s in alias.steps), now)
            new = self.graph.call_function(write_through_view, (self.current.get(root, root), steps, name, *args),
                                           kwargs)
        _inherit(new, node, _fresh(root.meta.get("val")))
        self.made_at[node] = self.version[root]          # its readers read the view replayed on the new value
        self._advance(root, new)
        self.replaced.append(node)

    def _advance(self, root: torch.fx.Node, value: torch.fx.Node) -> None:
        self.current[root] = value
        self.version[root] += 1
        self.made_at[value] = self.version[root]
        self.aliases[value] = Alias(root)

    def _others_read_after(self, node: torch.fx.Node, written: torch.fx.Node, root: torch.fx.Node) -> bool:
        """Whether a node after the write ``node`` reads the memory it writes other than through ``written``."""
        at = self.order[node]
        return any(self.last_read[m] > at for m in self.members[root] if m is not written and m is not node)

    def _refresh(self, node: torch.fx.Node) -> None:
        for source in list(node.all_input_nodes):
            now = self._now(source, node)
            if now is not source:
                node.replace_input_with(source, now)

    def _now(self, node: torch.fx.Node, reader: torch.fx.Node) -> torch.fx.Node:
        """``node`` as ``reader`` must read it: replayed on its root's current value if a write came after it."""
        alias = self.aliases.get(node)
        if alias is None or alias.root not in self.planned:
            return node
        version = self.version[alias.root]
        if self.made_at.get(node, version) >= version:
            return node
        return self._replay(alias, reader, node)

    def _replay(self, alias: Alias, reader: torch.fx.Node, stale: torch.fx.Node) -> torch.fx.Node:
        """The view ``alias`` of its root's current value, its view nodes copied just before ``reader``."""
        root = alias.root
        if alias.steps is None:
            maker = _op_name(_unreplayable(self.aliases, stale))
            raise _unplannable(self.last_write[root], f"{reader.name} at {source_of(reader)} reads the written memory "
                                                      f"afterwards through {stale.name}, a view of it that {maker} "
                                                      f"makes and Harmony cannot replay")
        value, version = self.current.get(root, root), self.version[root]
        for i, step in enumerate(alias.steps):
            if (step, version) not in self.replayed:
                with self.graph.inserting_before(reader):
                    args, kwargs = torch.fx.map_arg((step.args[1:], step.kwargs), lambda n: self._now(n, reader))
                    new = self.graph.create_node(step.op, step.target, (value, *args), kwargs, name=step.name)
                _inherit(new, step, step.meta.get("val"))
                self.aliases[new] = Alias(root, alias.steps[: i + 1])
                self.made_at[new] = version
                self.replayed[step, version] = new
            value = self.replayed[step, version]
        return value


def _written(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose value ``node`` writes in place (its first argument), or None."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        first = target._schema.arguments[:1]
        writes = bool(first) and first[0].alias_info is not None and first[0].alias_info.is_write
    elif node.op == "call_method":
        writes = target.endswith("_") and not target.startswith("_") and target not in _NOT_WRITES
    elif node.op == "call_function":
        name = getattr(target, "__name__", "")
        writes = (target in _OPERATORS or _inplace_argument(node)
                  or name.endswith("_") and not name.startswith("_") and getattr(torch, name, None) is target)
    else:
        writes = node.op == "call_module" and _out_of_place(gm, node) is not None
    return node.args[0] if writes else None


def _unreplayable(aliases: dict, node: torch.fx.Node) -> torch.fx.Node:
    """The node nearest the root on ``node``'s chain of views that no replay can follow (a module's output)."""
    while True:
        root = aliases[node].root
        source = next((s for s in node.all_input_nodes if s in aliases and aliases[s].root is root), None)
        if source is None or aliases[source].steps is not None:
            return node
        node = source


def _inherit(new: torch.fx.Node, old: torch.fx.Node, fallback) -> None:
    """``new`` takes ``old``'s metadata (source line, module path) and a fake value of its own."""
    new.meta.update({k: v for k, v in old.meta.items() if k not in ("val", "tensor_meta")})
    value = _fake_value(new)
    new.meta["val"] = value if value is not None else fallback


def _fake_value(node: torch.fx.Node):
    """``node`` run on its inputs' fake values, or None where that cannot be done."""
    args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    mode = next((v.fake_mode for v in pytree.tree_leaves((args, kwargs)) if hasattr(v, "fake_mode")), None)
    if mode is None or node.op not in ("call_function", "call_method"):
        return None
    try:
        with mode:
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the value is a hint; the cost model runs every node again
        return None


def _unplannable(node: torch.fx.Node, why: str) -> TraceError:
    return TraceError(
        f"in-place {_op_name(node)} at {source_of(node)} cannot be planned: {why}. Harmony trains graphs without "
        f"in-place writes to activations; write it out of place (y = torch.cat([a, b], -1), x = x + y) or put the "
        f"module that does it in leaf_modules")


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
